"""A tensor-parallel replica in a replica's process (issue 62): started inside a daemonic
``multiprocessing`` child, as ``replicas.py`` starts a replica, it starts its other rank, answers, stays
idle longer than a collective may wait, and answers again alike.

The other ranks wait for rank 0's next message on a pipe, not in a collective: only a pass's own
all-reduces time out (``RANK_TIMEOUT_S``, a stalled rank). Were the wait a collective, an idle replica
would fail after that long and restart with nothing wrong. Its own file: one process joins one group
at a time, and ``test_tensor_parallel.py`` holds its ranks for its whole module.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any


def _replica(folder: str, photo: bytes, out: Any) -> None:
    """A replica's process: 2 ranks with a 5 s collective timeout, a question, 7 s idle, the question again."""
    import torch

    from llava_sessions.config import Settings
    from llava_sessions.model import LlavaModel, parallel
    from llava_sessions.sampling.sampler import SamplingParams
    from llava_sessions.worker import build_engine

    parallel.RANK_TIMEOUT_S = 5
    torch.manual_seed(0)
    llava = LlavaModel.from_pretrained(folder, device="cpu", dtype="float32", tensor_parallel_size=2, threads=1)
    eng = build_engine(Settings(device="cpu", device_budget_bytes=10**9, tensor_parallel_size=2), llava)
    eng.open("s", photo)
    params = SamplingParams(max_new_tokens=6)
    first = [t.id for t in eng.generate("s", "What is it?", params, remember=False).tokens]
    time.sleep(7)  # idle past the 5 s a collective may wait
    alive = all(p.is_alive() for p in llava.ranks.processes)
    again = [t.id for t in eng.generate("s", "What is it?", params, remember=False).tokens]
    out.put((first, again, alive))
    llava.ranks.close()


def test_a_replica_process_starts_its_ranks_and_outlives_the_collectives_timeout_idle(tmp_path, small_photos):
    from llava_tools.tiny_model import write_checkpoint

    folder = write_checkpoint("tiny", tmp_path / "llava", arch="llava", max_positions=1024)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    replica = ctx.Process(target=_replica, args=(str(folder), small_photos["coffee"], out), daemon=True)
    replica.start()
    replica.join(120)
    assert replica.exitcode == 0, replica.exitcode
    first, again, alive = out.get()
    assert alive and first == again and len(first) == 6
