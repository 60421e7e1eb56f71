"""The KV cache's storage and its transformers ``Cache`` adapters: what a forward pass writes keys and
values into and reads them from.

========= ============================================================================================
module    owns
========= ============================================================================================
``pages`` the pool's bookkeeping in pages, no tensors: ``PagePool`` (free list, reference counts),
          ``PageTable`` (a holder's pages), fork / reserve (copy on write) / truncate / release
``paged`` the pages' tensors (``KVPages``) and the replica's ``KVPool``; a session's cache in them
          (``SessionKV``) and one pass over given slots, a sequence's or a decode step's rows
          (``SlotsCache``), through transformers' ``Cache`` interface
``cache`` what any cache a pass runs over answers: its length, a failed pass taken back
``runs``  a CPU's decode attention over each row's runs of consecutive pages, read as views of the pool
``flex``  FlexAttention's block mask over the pool's pages (``PageBlocks``) for the static decode step
========= ============================================================================================
"""

from __future__ import annotations

from .cache import cache_len, undo_pass
from .paged import KVPages, KVPool, SessionKV, SlotsCache
from .pages import PagePool, PageTable

__all__ = [
    "KVPages",
    "KVPool",
    "PagePool",
    "PageTable",
    "SessionKV",
    "SlotsCache",
    "cache_len",
    "undo_pass",
]
