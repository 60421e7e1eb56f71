"""Download a llava-hf checkpoint at a pinned commit into the image (the Dockerfile's bake step).

Runs before the project is installed (so a code change does not re-download the model); needs only
the standard library and ``huggingface_hub`` (a transformers dependency). A gated repository's
token is read from the BuildKit secret ``hf_token`` (``docker build --secret id=hf_token,src=...``).

    python bake_model.py --model-id llava-hf/llava-1.5-7b-hf --revision <40-hex commit> --dest /opt/llava/model
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
#: Files a llava-hf checkpoint folder needs (weights, configs, tokenizer, chat template).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
SECRET = Path("/run/secrets/hf_token")


def main(argv: list[str] | None = None) -> int:
    """Download ``--model-id`` at ``--revision`` into ``--dest``; exit 2 on a bad argument."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", required=True, help="e.g. llava-hf/llava-1.5-7b-hf")
    parser.add_argument("--revision", required=True, help="40-hex commit id: branches and tags move, an image must not")
    parser.add_argument("--dest", required=True, help="target folder")
    args = parser.parse_args(argv)
    if not COMMIT_RE.match(args.revision):
        print(f"bake_model: --revision must be a 40-hex commit id, got {args.revision!r}", file=sys.stderr)
        return 2
    from huggingface_hub import snapshot_download

    token = (SECRET.read_text().strip() or None) if SECRET.is_file() else None
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    snapshot_download(
        repo_id=args.model_id, revision=args.revision, local_dir=str(dest), token=token, allow_patterns=ALLOW_PATTERNS
    )
    if not (dest / "config.json").is_file():
        print(f"bake_model: {args.model_id}@{args.revision} has no config.json", file=sys.stderr)
        return 1
    print(f"bake_model: {args.model_id}@{args.revision} in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
