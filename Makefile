# Entry points: make install | make demo | make test  (and make web, make notebook, make lint, make bench)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
MODEL_DIR ?=
SIZE ?= tiny

.PHONY: install system-deps test demo web notebook bench lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,web]"
	touch $@

install: $(VENV)/.installed

# Java 17 (TorchServe) and Chromium + chromedriver (the browser test): apt-get as root, else named
system-deps:
	bash tests/system_deps.sh

test: install system-deps
	$(PY) -m pytest -q -ra

lint: install
	$(VENV)/bin/ruff check handler client tests benchmarks docker
	$(VENV)/bin/ruff format --check handler client tests benchmarks docker
	$(VENV)/bin/mypy

demo: install
	$(PY) -m llava_tools.demo $(if $(MODEL_DIR),--model-dir $(MODEL_DIR),)

web: install
	$(PY) -m llava_tools.webdemo $(if $(MODEL_DIR),--model-dir $(MODEL_DIR),) $(if $(PORT),--port $(PORT),)

# the notebook top to bottom, locally (its own TorchServe on the tiny model; no AWS)
notebook: install system-deps
	$(VENV)/bin/jupyter execute notebooks/llava_stateful_sessions.ipynb

bench: install
	$(PY) benchmarks/followup_latency.py --model bench
	$(PY) benchmarks/followup_latency.py --model bench --arch llava-next --image-size 672
	$(PY) benchmarks/chat_protocol.py --model bench

clean:
	rm -rf $(VENV) build *.egg-info
