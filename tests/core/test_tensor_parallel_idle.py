"""A tensor-parallel replica in a replica's process (issue 62): started inside a daemonic
``multiprocessing`` child, as ``replicas.py`` starts a replica, it starts its other rank, answers, stays
idle longer than a collective may wait, and answers again alike.

The other ranks wait for rank 0's next message on a pipe, not in a collective: only a pass's own
all-reduces time out (``RANK_TIMEOUT_S``, a stalled rank). Were the wait a collective, an idle replica
would fail after that long and restart with nothing wrong. Its own file: one process joins one group
at a time, and ``test_tensor_parallel.py`` holds its ranks for its whole module.

Then the other rank is killed, and the replica's watcher of its ranks' processes is left out: the next
question's own step (a message to a dead rank, a collective with it) must end rank 0 with
``RANK_DIED_EXIT``, not answer the question with an error (a stream's 500, as one CI run of
``tests/tools/test_tensor_parallel_serve.py`` saw when a collective failed before the watcher woke).
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any


def _replica(folder: str, photo: bytes, out: Any) -> None:
    """A replica's process: 2 ranks with a 5 s collective timeout, a question, 7 s idle, the question
    again; then the other rank killed and the question once more (rank 0 is to exit, never to answer)."""
    import torch

    from llava_sessions.config import Settings
    from llava_sessions.model import LlavaModel, parallel
    from llava_sessions.sampling.sampler import SamplingParams
    from llava_sessions.worker import build_engine

    parallel.RANK_TIMEOUT_S = 5
    parallel.RankGroup._watch = lambda self: None  # type: ignore[method-assign]  # the step's own check alone
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
    rank = llava.ranks.processes[0]
    rank.kill()
    rank.join()
    try:
        eng.generate("s", "What is it?", params, remember=False)
    except BaseException as exc:  # noqa: BLE001 - what a request would have been answered with
        out.put(f"answered with {type(exc).__name__}: {exc}")
        raise
    out.put("answered")


def test_a_replica_process_starts_its_ranks_outlives_the_collectives_timeout_idle_and_ends_with_a_rank(
    tmp_path, small_photos
):
    from llava_sessions.model.parallel import RANK_DIED_EXIT
    from llava_tools.tiny_model import write_checkpoint

    folder = write_checkpoint("tiny", tmp_path / "llava", arch="llava", max_positions=1024)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    replica = ctx.Process(target=_replica, args=(str(folder), small_photos["coffee"], out), daemon=True)
    replica.start()
    replica.join(120)
    first, again, alive = out.get()
    assert alive and first == again and len(first) == 6
    assert out.empty(), out.get()  # the question after the rank's death was answered, not ended
    assert replica.exitcode == RANK_DIED_EXIT, replica.exitcode
