"""A checkpoint's weights named as llava-hf's checkpoints on the hub name them (:func:`to_hub_layout`),
so the engines that load those by name (vLLM, SGLang, TGI) load ``llava-tiny-model``'s too."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["HUB_TOWER", "SAVED_TOWER", "hub_key", "to_hub_layout"]

#: The vision tower's key prefix in transformers 5's saved layout, and in llava-hf's checkpoints on the hub
#: (``llava-hf/llava-1.5-7b-hf``'s ``model.safetensors.index.json``: ``vision_tower.vision_model.encoder...``),
#: which vLLM's, SGLang's and TGI's LLaVA loaders read.
SAVED_TOWER, HUB_TOWER = "vision_tower.", "vision_tower.vision_model."


def hub_key(key: str) -> str:
    """A saved weight's name as llava-hf's checkpoints spell it (the vision tower's under ``vision_model``)."""
    if key.startswith(SAVED_TOWER) and not key.startswith(HUB_TOWER):
        return HUB_TOWER + key[len(SAVED_TOWER) :]
    return key


def to_hub_layout(folder: Path) -> int:
    """Rename the weights ``save_pretrained`` wrote in ``folder`` to llava-hf's key names (:func:`hub_key`;
    the tensors unchanged), in every ``*.safetensors`` file and the shards' index, so engines that load
    the hub's checkpoints by name load these too; transformers loads both layouts. Returns the keys renamed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    renamed = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
            tensors = {hub_key(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safetensors handle
            renamed += sum(hub_key(k) != k for k in f.keys())  # noqa: SIM118
        save_file(tensors, str(path), metadata=metadata)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {hub_key(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))
    return renamed
