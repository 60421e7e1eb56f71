#!/usr/bin/env bash
# `make gpu-smoke`: the cheapest useful device call, first on any lent GPU (at most 5 minutes of command
# time, carrying only the Python wheels of `make gpu-wheels`, no Java). gpu.txt first; then the GPU
# table's smoke sections (benchmarks/gpu.py --sections smoke: the engine's start and its graph counts,
# the floor and batch-1 decode, the cold image turn with its prefill replayed, device pixels against the
# host's, the vision tower and the decode steps replayed against eager, follow-up TTFT, 32 sessions), then
# a trimmed GPU suite with a timeout per test. Each part writes into OUT as it ends.
#
# On the device machine:   COMMIT=<git rev-parse HEAD> bash benchmarks/gpu_smoke.sh
# On a CPU, to check the script itself:
#   LLAVA_TEST_DEVICE=cpu SMOKE_TABLE_ARGS="--device cpu --model tiny --dtype auto --levels 1,2 --new-tokens 4" \
#   SMOKE_TESTS=tests/core/test_gpu_start.py bash benchmarks/gpu_smoke.sh
set -u
# shellcheck source=benchmarks/gpu_setup.sh
. "$(dirname "$0")/gpu_setup.sh"

read -r -a table <<< "${SMOKE_TABLE_ARGS:---levels 1,32 --kernel-rows= --compare-paged-read off}"
timeout -k 5 "${SMOKE_TABLE_TIMEOUT_S:-115}" "$python" benchmarks/gpu.py "${table[@]}" --sections smoke \
  --json "$out/gpu_smoke.json" --deadline-s "${SMOKE_TABLE_DEADLINE_S:-85}" > "$out/gpu_smoke_log.txt" 2>&1
echo "GPU table, smoke sections: exit $?"
tail -n 30 "$out/gpu_smoke_log.txt"

read -r -a tests <<< "${SMOKE_TESTS:-tests/gpu}"
timeout -k 5 "${SMOKE_TESTS_TIMEOUT_S:-95}" "$python" -m pytest -q -ra -p no:cacheprovider "${per_test[@]}" \
  "${tests[@]}" > "$out/gpu_smoke_tests.txt" 2>&1
echo "GPU suite, trimmed: exit $?"
tail -n 15 "$out/gpu_smoke_tests.txt"
