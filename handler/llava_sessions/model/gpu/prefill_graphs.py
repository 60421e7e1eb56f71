"""A prefill chunk of one sequence at static shapes over the KV pool, captured as CUDA graphs.

In a cold image turn the vision tower replays as a graph, and the ~600-token image prefill ran
eagerly: some 1,400 kernel launches whose host time exceeds the pass's weights and arithmetic (a 7b
model reads 14 GB and multiplies ~8 TFLOP for 600 tokens; benchmarks/results/the-gpu-table.md). A text chunk of up to 64 tokens already runs as the rows of a static decode
step (:meth:`.graphs.DecodeGraphs.run_with_chunks`); a chunk with image placeholders, or a longer one,
ran at its own shape. :class:`PrefillGraphs` runs such a chunk of ``n`` new tokens after ``start``
cached positions in a bucket ``(T, L)``: the smallest chunk size of :data:`PREFILL_CHUNK_SIZES` that
holds ``n``, and the smallest attended length of :func:`~.graphs.length_buckets` (up to
:data:`MAX_PREFILL_LENGTH`) that holds ``start + n``. Every input lives in persistent buffers:

- ``embeds`` ``[1, T, hidden]``: the chunk's input embeddings (image features merged, eagerly, before the
  pass: :meth:`LlavaModel.embed <.llava.LlavaModel.embed>`), pad rows after them;
- ``positions`` ``[1, T]`` long; ``write`` ``[T]`` long: the pool slot of each row's position (a pad
  row's: the scratch page's first slot);
- ``read`` ``[1, L]`` long: the slots attention reads, the table's positions in order, then the scratch
  page's; ``ends`` ``[T]`` long: each row attends to read positions below its end (row ``i``:
  ``start + i + 1``; a pad row: 1), the mask ``[1, 1, T, L]`` built from it inside the pass;
- ``last`` ``[1]`` long: the row whose logits the pass keeps (``n - 1``).

Pad rows come after the chunk's rows, so causal attention keeps them out of every real row; each layer
writes the chunk's keys and values before attention reads, as the eager pass does. On a CUDA device each
bucket is captured once at start (:meth:`PrefillGraphs.capture`, the largest first, in the decode graphs'
memory pool: the two never run at once), and a chunk is an embedding, buffer copies and one replay. On a
CPU the same static pass runs eagerly; the tests run it there against ``model.generate``.

References: PyTorch, "CUDA Graphs" (``torch.cuda.graph``, ``CUDAGraph.replay``, the ``pool`` argument);
transformers' ``logits_to_keep`` (a tensor of indices keeps those positions' logits).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..kv.paged import KVPool, SlotsCache, page_slots
from ..kv.pages import PageTable, truncate
from .graph_table import GraphTable
from .graphs import length_buckets
from .staging import HostStaging

if TYPE_CHECKING:
    from ..llava import LlavaModel

__all__ = ["MAX_PREFILL_LENGTH", "PREFILL_CHUNK_SIZES", "PrefillGraphs"]

log = logging.getLogger(__name__)

#: The chunk sizes (tokens) a prefill graph is captured for. llava-1.5's open (system prompt, the image's
#: 576 placeholders) is ~590 tokens: the 640 bucket. Chunks of up to 64 text tokens are a decode step's
#: rows instead (:mod:`.graphs`). A guess until a GPU measures the padding against the graphs' count.
PREFILL_CHUNK_SIZES = (128, 256, 512, 640, 768, 1024)

#: The longest attended length (positions) a prefill graph is captured for; a chunk after a longer
#: conversation runs at its own shape.
MAX_PREFILL_LENGTH = 2048


class PrefillGraphs:
    """Prefill chunks at static shapes over ``pool`` (module docstring).

    Args:
        model: the loaded model (:meth:`~..llava.LlavaModel.text_pass` is the captured pass).
        pool: the replica's KV pool.
        scratch: a page of ``pool`` no holder writes (the decode graphs' scratch page), which pad rows
            write and unused read positions point at.
        max_len: the model's context (positions); buckets stop at it or :data:`MAX_PREFILL_LENGTH`.

    Attributes:
        chunks: the pass's :class:`~.graph_table.GraphTable` by bucket (its ``num_replays``, ``num_eager``
            and ``replay`` switch: ``benchmarks/gpu.py``'s check of replay against the same pass).
    """

    def __init__(self, model: LlavaModel, pool: KVPool, scratch: int, *, max_len: int) -> None:
        self.model, self.pool = model, pool
        self.sizes = list(PREFILL_CHUNK_SIZES)
        self.lengths = length_buckets(min(max_len, MAX_PREFILL_LENGTH), pool.page_size)
        device, top = pool.pages.keys[0].device, self.sizes[-1]
        hidden = int(model.config.text_config.hidden_size)
        self._pad_slot = scratch * pool.page_size
        self._embeds = torch.zeros(1, top, hidden, dtype=model.dtype, device=device)
        self._positions = torch.zeros(1, top, dtype=torch.long, device=device)
        self._write = torch.full((top,), self._pad_slot, dtype=torch.long, device=device)
        self._read = torch.full((1, self.lengths[-1]), self._pad_slot, dtype=torch.long, device=device)
        self._ends = torch.ones(top, dtype=torch.long, device=device)
        self._columns = torch.arange(self.lengths[-1], device=device)
        self._last = torch.zeros(1, dtype=torch.long, device=device)
        self._staging = HostStaging(device)
        self.chunks: GraphTable[tuple[int, int]] = GraphTable(lambda key: self._pass(*key))

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """Every bucket ``(T, L)`` (``L >= T``), the largest first (the order of capture)."""
        return sorted(((t, L) for t in self.sizes for L in self.lengths if t <= L), reverse=True)

    def bucket(self, num_new: int, longest: int) -> tuple[int, int] | None:
        """The bucket of a chunk of ``num_new`` tokens that ends at position ``longest`` (its start plus
        ``num_new``); None when it is larger than every bucket."""
        size = next((t for t in self.sizes if t >= num_new), None)
        if size is None:
            return None
        length = next((L for L in self.lengths if max(longest, size) <= L), None)
        return None if length is None else (size, length)

    def capture(self, mempool: Any = None) -> None:
        """Capture every bucket's pass as a CUDA graph, the largest first, in ``mempool`` (a graph pool
        handle to share, or None for a new one); each pass run once eagerly first, over the scratch
        page only.

        Raises:
            RuntimeError: not on a CUDA device, or the capture failed (the caller runs chunks eagerly).
        """
        with torch.inference_mode():
            self.chunks.capture(self.buckets, device=self._embeds.device, pool=mempool)
        log.info(
            "captured %d prefill graphs (chunks %s x lengths %s)", self.chunks.num_graphs, self.sizes, self.lengths
        )

    @torch.inference_mode()
    def prefill(
        self, table: PageTable, ids: Sequence[int], first_row: int, image_features: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Prefill ``ids`` after ``table``'s positions in one static pass: replayed when its bucket was
        captured, else run at static shapes eagerly.

        Args:
            table: the sequence's page table (extended by ``len(ids)`` positions).
            ids: the chunk's token ids; image placeholders take rows of ``image_features`` from
                ``first_row`` on (:meth:`LlavaModel.embed <.llava.LlavaModel.embed>`).
            first_row, image_features: as :meth:`LlavaModel.embed <.llava.LlavaModel.embed>`.

        Returns:
            Logits ``[vocab]`` float32 of the chunk's last position; None when no bucket holds the chunk
            (nothing reserved or written: the caller prefills its own way).

        Raises:
            torch.OutOfMemoryError: the pool has too few free pages. On any failure ``table`` is as
                before the call.
        """
        start, n = table.num_tokens, len(ids)
        key = self.bucket(n, start + n) if n else None
        if key is None:
            return None
        embeds = self.model.embed(list(ids), first_row, image_features)
        self.pool.make_room(table, n)
        try:
            self._fill(table, start, embeds, *key)
            return self.chunks(key)
        except BaseException:
            truncate(self.pool.pool, table, start)  # a failed pass leaves its positions behind: take them back
            raise

    def _fill(self, table: PageTable, start: int, embeds: torch.Tensor, size: int, length: int) -> None:
        """Overwrite the buffers for a chunk of ``embeds`` (``[1, n, hidden]``) after ``start`` positions
        of ``table`` (already extended by the chunk), in bucket ``(size, length)``."""
        n, page = embeds.shape[1], self.pool.page_size
        slots = page_slots([table.pages], page, width=length // page, pad=self._pad_slot // page)[0]
        write = torch.full((size,), self._pad_slot, dtype=torch.long)
        write[:n] = slots[start : start + n]
        ends = torch.ones(size, dtype=torch.long)
        ends[:n] = torch.arange(start + 1, start + n + 1)
        positions = torch.full((1, size), start + n - 1, dtype=torch.long)
        positions[0, :n] = torch.arange(start, start + n)
        self._embeds[:, :n].copy_(embeds)
        staging = self._staging
        staging.begin()  # the last chunk's copies read the pinned buffers: done before they are written
        staging.upload("write", self._write[:size], write)
        staging.upload("read", self._read[:, :length], slots[None])
        staging.upload("ends", self._ends[:size], ends)
        staging.upload("positions", self._positions[:, :size], positions)
        staging.upload("last", self._last, torch.tensor([n - 1]))
        staging.end()

    def _pass(self, size: int, length: int) -> torch.Tensor:
        """The static pass of bucket ``(size, length)`` over the buffers: logits ``[vocab]`` float32."""
        write, read = self._write[:size], self._read[:, :length]
        mask = (self._columns[None, :length] < self._ends[:size, None])[None, None]
        out = self.model.text_pass(
            SlotsCache(self.pool.pages, write, read, size),
            inputs_embeds=self._embeds[:, :size],
            attention_mask=mask,
            position_ids=self._positions[:, :size],
            logits_to_keep=self._last,
        )
        return out.logits[0, 0].float()
