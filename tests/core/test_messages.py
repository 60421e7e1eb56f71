"""Messages a user reads count in plain English: one session, two sessions."""

from __future__ import annotations

import logging

import pytest

from llava_sessions.errors import ServiceError, counted
from llava_sessions.sessions.store import SessionStore


def test_counted_nouns_are_plural_unless_one():
    assert [counted(n, "session") for n in (0, 1, 2)] == ["0 sessions", "1 session", "2 sessions"]
    assert counted(1, "entry", "entries") == "1 entry" and counted(3, "entry", "entries") == "3 entries"


def test_a_full_worker_says_its_maximum_in_the_singular_too():
    store = SessionStore(device_budget_bytes=1 << 30, host_budget_bytes=1 << 30, kv_bytes_per_token=1, max_sessions=1)
    store.add(store.new_session("a", None, [], [], []))
    with pytest.raises(ServiceError, match=r"its maximum of 1 session$"):
        store.add(store.new_session("b", None, [], [], []))


def test_the_client_logs_one_remembered_turn_in_the_singular(caplog):
    from llava_client._sessions import _turns

    assert _turns(1, "remembered ") == "1 remembered turn" and _turns(2) == "2 turns"
    with caplog.at_level(logging.WARNING):
        logging.getLogger("llava_client").warning("restored with its %s", _turns(1, "remembered "))
    assert "with its 1 remembered turn" in caplog.text and "turns" not in caplog.text
