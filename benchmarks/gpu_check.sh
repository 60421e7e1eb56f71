#!/usr/bin/env bash
# The card check in one device call (issue 59 item 6; `make gpu-check`): the GPU suite (tests/gpu and
# the core tests that compare the engine with itself, on the card), the in-process GPU table
# (benchmarks/gpu.py), then the TorchServe table (benchmarks/gpu_serve.py: llava-serve over HTTP beside
# TorchServe's floor), then the in-process table's first rows again on the checkpoint the TorchServe
# table loaded, each under a timeout so the whole fits in about 9 minutes, each writing what it found
# into OUT as it ends (the device call's $OUT; ./gpu-check here). The device machine has no Java:
# `make gpu-wheels` packs a runtime and TorchServe's frontend into .whl (benchmarks/gpu_bundle.py).
#
# On the device machine (its own python3, torch and pytest; `make gpu-wheels` here first, carry .whl):
#   COMMIT=<git rev-parse HEAD> bash benchmarks/gpu_check.sh
# On a CPU, to check the script itself:
#   LLAVA_TEST_DEVICE=cpu GPU_TABLE_ARGS="--device cpu --model tiny --dtype auto --levels 1,2" \
#   GPU_SERVE_ARGS="--device cpu --model tiny --dtype auto --streams 2" \
#   GPU_AGAIN_ARGS="--device cpu --dtype auto --levels 1,2 --skip-peer --skip-other-layout --kernel-rows=" \
#   bash benchmarks/gpu_check.sh
# (add "--decode-layout paged --cuda-graphs on --async-scheduling on" to GPU_TABLE_ARGS for the sections
# a card's static step has: graphs against eager, async scheduling)
set -u
out=${OUT:-gpu-check}
mkdir -p "$out"
if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then  # what the device machine lacks, by version
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:handler:client:benchmarks
fi
if [ -f .whl/java-runtime.tar.xz ]; then  # TorchServe's Java and frontend jar (benchmarks/gpu_bundle.py)
  python3 benchmarks/gpu_bundle.py unpack --bundle .whl --site /tmp/site --java /tmp/java || exit 1
  export JAVA_HOME=/tmp/java PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 LLAVA_TEST_DEVICE=${LLAVA_TEST_DEVICE:-cuda}
python=${PYTHON:-python3}
{
  echo "commit: ${COMMIT:-unknown}"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "card: none"
  "$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$out/card.txt" 2>&1
cat "$out/card.txt"

tests=(
  tests/gpu
  "tests/core/test_batching.py::test_batched_answers_equal_answers_alone_with_joins_and_leaves"
  "tests/core/test_batching.py::test_questions_arriving_together_prefill_as_rows_of_shared_static_steps_and_answer_as_alone"
  "tests/core/test_memory_plan.py::test_answers_that_outgrow_memory_are_preempted_newest_first_and_resume_exactly"
  "tests/core/test_async_scheduling.py::test_answers_launched_ahead_are_the_answers_in_step_and_leave_the_same_sessions"
)
# a video session on the card needs PyAV (36 MB), which the device machine lacks and the carry has no
# room for beside Java: in a call of its own, its wheel in .whl, this script runs it too
if "$python" -c "import av" 2> /dev/null; then
  tests+=("tests/core/test_video_session.py::test_a_video_session_answers_as_generate_does_from_every_tier")
fi
timeout "${GPU_TESTS_TIMEOUT_S:-170}" "$python" -m pytest -q -ra -p no:cacheprovider "${tests[@]}" \
  > "$out/gpu_tests.txt" 2>&1
echo "GPU suite: exit $?"
tail -n 15 "$out/gpu_tests.txt"

read -r -a table <<< "${GPU_TABLE_ARGS:---skip-other-layout --kernel-rows= --compare-paged-read off}"
timeout "${GPU_TABLE_TIMEOUT_S:-150}" "$python" benchmarks/gpu.py "${table[@]}" --json "$out/gpu.json" \
  --deadline-s "${GPU_TABLE_DEADLINE_S:-110}" > "$out/gpu_log.txt" 2>&1
echo "GPU table: exit $?"
tail -n 40 "$out/gpu_log.txt"

read -r -a serve <<< "${GPU_SERVE_ARGS:-}"
timeout "${GPU_SERVE_TIMEOUT_S:-210}" "$python" benchmarks/gpu_serve.py "${serve[@]}" --in-process "$out/gpu.json" \
  --json "$out/gpu_serve.json" --work-dir "${GPU_SERVE_DIR:-/tmp}" > "$out/gpu_serve_log.txt" 2>&1
echo "TorchServe table: exit $?"
tail -n 40 "$out/gpu_serve_log.txt"

# the in-process table's first rows again on the checkpoint the TorchServe table loaded (the main table
# builds the model in memory): the same model loaded the same way on both sides of the comparison
if [ -f "${GPU_SERVE_DIR:-/tmp}/model/config.json" ]; then
  read -r -a again <<< "${GPU_AGAIN_ARGS:---levels 1,32 --skip-peer --skip-other-layout --kernel-rows= --compare-paged-read off}"
  timeout "${GPU_AGAIN_TIMEOUT_S:-90}" "$python" benchmarks/gpu.py --model-dir "${GPU_SERVE_DIR:-/tmp}/model" "${again[@]}" \
    --json "$out/gpu_from_disk.json" --deadline-s "${GPU_AGAIN_DEADLINE_S:-55}" > /dev/null 2>&1
  echo "GPU table from the checkpoint: exit $?"
  "$python" -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('engine_start_s', 'batch_one', 'aggregate', 'skipped', 'errors')})" "$out/gpu_from_disk.json"
fi
