"""A tensor-parallel replica left idle longer than a collective may wait still answers (issue 62).

The other ranks wait for rank 0's next message on a pipe, not in a collective: only a pass's own
all-reduces time out (``RANK_TIMEOUT_S``, a stalled rank). Were the wait a collective, an idle replica
would fail after that long and restart with nothing wrong. Its own file: one process joins one group
at a time, and ``test_tensor_parallel.py`` holds its ranks for its whole module.
"""

from __future__ import annotations

import time

import torch

from llava_sessions.config import Settings
from llava_sessions.model import LlavaModel, parallel
from llava_sessions.sampling.sampler import SamplingParams
from llava_sessions.worker import build_engine


def test_an_idle_replica_outlives_the_collectives_timeout(tmp_path, small_photos, monkeypatch) -> None:
    from llava_tools.tiny_model import write_checkpoint

    monkeypatch.setattr(parallel, "RANK_TIMEOUT_S", 20)  # room for the other rank to join
    folder = write_checkpoint("tiny", tmp_path / "llava", arch="llava", max_positions=1024)
    torch.manual_seed(0)
    llava = LlavaModel.from_pretrained(folder, device="cpu", dtype="float32", tensor_parallel_size=2, threads=1)
    try:
        eng = build_engine(Settings(device="cpu", device_budget_bytes=10**9, tensor_parallel_size=2), llava)
        eng.open("s", small_photos["coffee"])
        params = SamplingParams(max_new_tokens=6)
        first = [t.id for t in eng.generate("s", "What is it?", params, remember=False).tokens]
        time.sleep(22)  # idle past the 20 s a collective may wait
        assert all(p.is_alive() for p in llava.ranks.processes)
        assert [t.id for t in eng.generate("s", "What is it?", params, remember=False).tokens] == first
    finally:
        llava.ranks.close()
