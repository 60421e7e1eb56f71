"""The conversation's plain-data helpers: the common prefix of two token-id lists, dropping old turns."""

from __future__ import annotations

from hypothesis import given, strategies as st

from llava_sessions.conversation import Chat, Turn, common_prefix_len


def naive_common_prefix_len(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


@given(st.lists(st.integers(0, 3), max_size=80), st.lists(st.integers(0, 3), max_size=80))
def test_common_prefix_len_is_the_first_difference(a: list[int], b: list[int]) -> None:
    assert common_prefix_len(a, b) == naive_common_prefix_len(a, b)
    assert common_prefix_len(a, a + b) == len(a)  # one extends the other


@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=700), st.data())
def test_common_prefix_len_finds_one_changed_token_anywhere(ids: list[int], data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(ids) - 1))
    edited = [*ids[:at], ids[at] + 1, *ids[at + 1 :]]
    assert common_prefix_len(ids, edited) == at == common_prefix_len(edited, ids)


def test_without_oldest_moves_the_dropped_turns_images_to_the_first_turn_kept() -> None:
    chat = Chat("sys", (Turn("q1", "a1", 2), Turn("q2", "a2", 0), Turn("q3", "a3", 1)), 1, (5, 5, 5, 5))
    assert chat.without_oldest(2).turns == (Turn("q3", "a3", 3),)
    assert chat.without_oldest(3).turns == () and chat.without_oldest(3).pending_images == 4
    assert chat.without_oldest(0) is chat
