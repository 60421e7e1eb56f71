#!/usr/bin/env bash
# shellcheck disable=SC2034  # per_test is read by the scripts that source this one
# Sourced by benchmarks/gpu_smoke.sh and benchmarks/gpu_check.sh on the device machine: OUT made, gpu.txt
# written first (the GPU, the commit, the stack), then the Python wheels `make gpu-wheels` packed into .whl
# (and .whl-serve, where carried) installed into /tmp/site (what the machine lacks, by version). Every step is under a timeout of its own,
# and the scripts' timeouts add up to what one device call allows (tests/project/test_build_scripts.py).
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLAVA_TEST_DEVICE=${LLAVA_TEST_DEVICE:-cuda}
python=${PYTHON:-python3}
{
  echo "commit: ${COMMIT:-unknown}"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "gpu: none"
} > "$out/gpu.txt" 2>&1
wheels=()
for wheel in .whl/*.whl .whl-serve/*.whl; do [ -f "$wheel" ] && wheels+=("$wheel"); done
if [ "${#wheels[@]}" -gt 0 ]; then
  if timeout 40 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}"; then
    export PYTHONPATH=/tmp/site:handler:client:benchmarks
  else
    echo "installing .whl failed: the stack as the machine has it" >> "$out/gpu.txt"
  fi
fi
timeout 20 "$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
# the per-test timeout of the GPU suites, where pytest-timeout is there (a hang costs one test, not the part)
per_test=()
if timeout 10 "$python" -c "import pytest_timeout" 2> /dev/null; then  # a plugin pytest loads itself
  per_test=(--timeout "${GPU_TEST_TIMEOUT_S:-60}")
fi
