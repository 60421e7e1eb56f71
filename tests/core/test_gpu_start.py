"""What a GPU's start depends on, checked where a CPU can check it: a capture that recorded nothing, or
a replay that differs from its eager pass, is an error naming the graph; ``dtype: auto`` is the dtype
the GPU figures were measured in; the CUDA graphs' memory comes out of the sessions' budget; the pool's
page count lands on a few sizes; and the image turn's embedding reads no device value on the host.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llava_sessions.model.gpu.graph_table import EMPTY_GRAPH_WARNING, capture_failed, check_replay, refuse_empty
from llava_sessions.model.loading import auto_dtype
from llava_sessions.sessions.budget import (
    MAX_GATHERED_ROWS,
    MAX_GRAPH_ROWS,
    MAX_PREFILL_CHUNK,
    MAX_PREFILL_LENGTH,
    GraphShapes,
    graph_reserve_bytes,
    ladder_pages,
)


def test_an_empty_capture_is_an_error_naming_its_graph():
    """PyTorch only warns when a graph captured nothing (its passes ran on another device's stream):
    the capture loop refuses it, so a replica never replays capture-time logits."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(f"{EMPTY_GRAPH_WARNING}. This usually means that the graph was attempted ...", stacklevel=1)
    with pytest.raises(RuntimeError, match=r"\(8, 640\) captured no work"):
        refuse_empty([str(w.message) for w in caught], (8, 640))
    refuse_empty(["some other warning"], (8, 640))


def test_a_replay_is_checked_against_its_eager_pass():
    eager = torch.randn(4, 100) * 10
    check_replay("k", eager, eager.clone())
    check_replay("k", eager.bfloat16(), (eager + 0.01).bfloat16())  # 16-bit: within 1e-2 of the scale
    with pytest.raises(RuntimeError, match="'k' replays"):
        check_replay("k", eager, eager + 0.1)  # float32: 1e-4 of the scale at most
    with pytest.raises(RuntimeError, match="captured|replays"):
        check_replay("k", eager, torch.zeros_like(eager))  # a graph that never ran: its output as allocated
    with pytest.raises(RuntimeError, match="shape"):
        check_replay("k", eager, eager[:2])
    stale = eager.clone()
    stale[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        check_replay("k", eager, stale)


def test_a_failed_capture_says_so_in_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="llava_sessions"):
        capture_failed("the decode steps as CUDA graphs", "decode steps run eagerly", RuntimeError("boom\nline two"))
    (record,) = caplog.records
    assert record.getMessage() == (
        "capturing the decode steps as CUDA graphs failed (RuntimeError: boom); decode steps run eagerly"
    )
    assert record.exc_info is None and "\n" not in record.getMessage()


def test_dtype_auto_is_bf16_on_gpus_that_compute_in_it():
    assert auto_dtype("cpu") == torch.float32
    assert auto_dtype("cuda", (8, 6)) == torch.bfloat16  # A10G (ml.g5)
    assert auto_dtype("cuda", (9, 0)) == torch.bfloat16  # H100, H200
    assert auto_dtype("cuda", (7, 5)) == torch.float16  # T4 (ml.g4dn)
    assert auto_dtype("cuda", (7, 0)) == torch.float16  # V100 (ml.p3)


def test_the_pool_s_page_count_lands_on_one_of_sixteen_sizes_per_doubling():
    for n in [*range(1, 300), 17_000, 123_456, 2**20 + 1]:
        kept = ladder_pages(n)
        assert kept <= n and kept >= n * 16 / 17 - 1e-9 and ladder_pages(kept) == kept
    # free memory that varies by under 1% between starts (here 10,000 to 10,099 pages) gives one or two counts
    assert len({ladder_pages(n) for n in range(10_000, 10_100)}) <= 2
    assert ladder_pages(0) == 0 and ladder_pages(15) == 15 and ladder_pages(33) == 32


def test_the_budget_s_constants_are_the_engine_s():
    from llava_sessions.engine.model_runner import MAX_GRAPH_ROWS as RUNNER_ROWS
    from llava_sessions.model.gpu.graphs import FLEX_MIN_ROWS, batch_buckets
    from llava_sessions.model.gpu.prefill_graphs import MAX_PREFILL_LENGTH as PREFILL_LENGTH, PREFILL_CHUNK_SIZES

    assert MAX_GRAPH_ROWS == RUNNER_ROWS and MAX_PREFILL_LENGTH == PREFILL_LENGTH
    assert max(PREFILL_CHUNK_SIZES) == MAX_PREFILL_CHUNK
    assert max(b for b in batch_buckets(RUNNER_ROWS) if b < FLEX_MIN_ROWS) == MAX_GATHERED_ROWS


def test_the_graphs_reserve_grows_with_what_they_capture():
    llava15 = GraphShapes.from_config({})  # llava-1.5-7b's defaults
    next_ = GraphShapes.from_config(
        {
            "text_config": {"num_key_value_heads": 8, "intermediate_size": 14336, "max_position_embeddings": 32768},
            "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        }
    )
    assert llava15.tile_counts == (1,) and next_.tile_counts == (1, 3, 4, 5)
    small, tiled = graph_reserve_bytes(llava15, 2), graph_reserve_bytes(next_, 2)
    assert 0.2 * 2**30 < small < 0.5 * 2**30 < tiled  # llava-1.5-7b in bf16: about 0.3 GiB
    assert graph_reserve_bytes(llava15, 4) > small and graph_reserve_bytes(llava15, 2, max_rows=8) < small


def test_a_cpu_engine_keeps_nothing_for_graphs(llava):
    from llava_sessions.config import Settings
    from llava_sessions.worker import gpu_graph_reserve

    assert gpu_graph_reserve(Settings.from_sources({}), llava) == 0


class _HostReads(TorchDispatchMode):
    """The ops that make the host wait for the device: a value read back (``item``, ``bool``), or a
    boolean mask's nonzero count."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if name in ("_local_scalar_dense", "nonzero", "masked_select", "masked_scatter") or (
            name == "index_put_" and any(getattr(i, "dtype", None) == torch.bool for i in (args[1] or []))
        ):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_an_image_chunk_s_embedding_reads_no_device_value_on_the_host(llava):
    """The mixed step embeds an image's chunk between its decode replay and its prefill replay: an op
    that reads a device value there makes the host wait out the decode step. The embedding equals the
    model's own merge of the features into the placeholders."""
    image_id, n = llava.image_token_id, 5
    ids = [1, 2, image_id, image_id, image_id, 7, image_id, image_id, 9]
    features = torch.randn(n + 2, llava.config.text_config.hidden_size)
    with torch.inference_mode():
        with _HostReads() as reads:
            embeds = llava.embed(ids, 2, features)
        assert reads.names == []
        plain = llava.model.get_input_embeddings()(torch.tensor([ids]))
    at = [i for i, t in enumerate(ids) if t == image_id]
    assert torch.equal(embeds[0, at], features[2 : 2 + n].to(embeds.dtype))
    others = [i for i in range(len(ids)) if i not in at]
    assert torch.equal(embeds[0, others], plain[0, others])
    with torch.inference_mode():  # fewer rows left than placeholders: the last placeholders stay text
        short = llava.embed(ids, n, features)
    assert torch.equal(short[0, at[:2]], features[n:].to(short.dtype))
    assert torch.equal(short[0, at[2:]], plain[0, at[2:]])


def test_a_cpu_s_session_budget_is_the_setting_or_a_share_of_what_is_free(llava):
    """On a CPU nothing is kept for graphs and the pool grows, so the budget is not rounded to pages."""
    from llava_sessions.config import Settings
    from llava_sessions.engine import available_host_bytes
    from llava_sessions.worker import session_budget

    assert session_budget(Settings.from_sources({"device_budget_bytes": 12_345}), llava) == 12_345
    free = available_host_bytes()
    share = session_budget(Settings.from_sources({"device_budget_fraction": 0.5}), llava)
    assert abs(share - free * 0.5) < 0.05 * free
