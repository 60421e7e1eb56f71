#!/usr/bin/env bash
# `make gpu-check`: the rest of the GPU check, after `make gpu-smoke`, in at most 8 minutes of command time
# (docs/decisions/58-the-gpu-check.md): the whole GPU suite (tests/gpu and the core tests that compare the
# engine with itself, on the GPU) with a timeout per test, the GPU table's other sections
# (benchmarks/gpu.py --sections rest), then the TorchServe table (benchmarks/gpu_serve.py: llava-serve
# over HTTP beside TorchServe's floor). gpu.txt first; each part writes into OUT (the device call's $OUT;
# ./gpu-check here) as it ends. The device machine has no Java: `make gpu-wheels` packs a runtime and
# TorchServe's frontend into .whl-serve (benchmarks/gpu_bundle.py); if they cannot be unpacked, only the
# TorchServe part is skipped.
#
# On the device machine (its own python3, torch and pytest; `make gpu-wheels` here first, carry .whl and
# .whl-serve):
#   COMMIT=<git rev-parse HEAD> bash benchmarks/gpu_check.sh
# On a CPU, to check the script itself:
#   LLAVA_TEST_DEVICE=cpu GPU_TABLE_ARGS="--device cpu --model tiny --dtype auto --levels 1,2" \
#   GPU_SERVE_ARGS="--device cpu --model tiny --dtype auto --streams 2" bash benchmarks/gpu_check.sh
# (add "--cuda-graphs on --async-scheduling on" to GPU_TABLE_ARGS for the sections
# a GPU's static step has: graphs against eager, async scheduling)
set -u
# shellcheck source=benchmarks/gpu_setup.sh
. "$(dirname "$0")/gpu_setup.sh"
java=no
if [ -f .whl-serve/java-runtime.tar.xz ]; then  # TorchServe's Java and frontend jar (benchmarks/gpu_bundle.py)
  if timeout 30 "$python" benchmarks/gpu_bundle.py unpack --bundle .whl-serve --site /tmp/site --java /tmp/java \
    > "$out/java_unpack.txt" 2>&1; then
    export JAVA_HOME=/tmp/java PATH=/tmp/site/bin:$PATH
    java=yes
  fi
fi
command -v java > /dev/null && java=yes

tests=(
  tests/gpu
  "tests/core/test_batching.py::test_batched_answers_equal_answers_alone_with_joins_and_leaves"
  "tests/core/test_batching.py::test_questions_arriving_together_prefill_as_rows_of_shared_static_steps_and_answer_as_alone"
  "tests/core/test_memory_plan.py::test_answers_that_outgrow_memory_are_preempted_newest_first_and_resume_exactly"
  "tests/core/test_async_scheduling.py::test_answers_launched_ahead_are_the_answers_in_step_and_leave_the_same_sessions"
)
# a video session on the GPU needs PyAV (36 MB), which the device machine lacks and the carry has no
# room for beside Java: in a call of its own, its wheel in .whl, this script runs it too
if timeout 10 "$python" -c "import av" 2> /dev/null; then
  tests+=("tests/core/test_video_session.py::test_a_video_session_answers_as_generate_does_from_every_tier")
fi
timeout -k 5 "${GPU_TESTS_TIMEOUT_S:-115}" "$python" -m pytest -q -ra -p no:cacheprovider "${per_test[@]}" \
  "${tests[@]}" > "$out/gpu_tests.txt" 2>&1
echo "GPU suite: exit $?"
tail -n 15 "$out/gpu_tests.txt"

# the smoke call's sections are not run again but the three the TorchServe table's goals read, first
read -r -a table <<< "${GPU_TABLE_ARGS:---levels 1,32 --kernel-rows= --compare-paged-read off}"
sections=${GPU_TABLE_SECTIONS:-batch_one,turns,aggregate,rest}
timeout -k 5 "${GPU_TABLE_TIMEOUT_S:-85}" "$python" benchmarks/gpu.py "${table[@]}" --sections "$sections" \
  --json "$out/gpu.json" --deadline-s "${GPU_TABLE_DEADLINE_S:-65}" > "$out/gpu_log.txt" 2>&1
echo "GPU table: exit $?"
tail -n 40 "$out/gpu_log.txt"

if [ "$java" = yes ]; then
  read -r -a serve <<< "${GPU_SERVE_ARGS:-}"
  # gpu_serve.py stops its servers' process groups on SIGTERM, what timeout sends first (then KILL)
  timeout -k 10 "${GPU_SERVE_TIMEOUT_S:-140}" "$python" benchmarks/gpu_serve.py "${serve[@]}" \
    --in-process "$out/gpu.json" --json "$out/gpu_serve.json" --work-dir "${GPU_SERVE_DIR:-/tmp}" \
    --deadline-s "${GPU_SERVE_DEADLINE_S:-110}" > "$out/gpu_serve_log.txt" 2>&1
  echo "TorchServe table: exit $?"
  tail -n 40 "$out/gpu_serve_log.txt"
else
  echo "TorchServe table: skipped (no Java: carry .whl-serve from make gpu-wheels; $out/java_unpack.txt)"
fi
