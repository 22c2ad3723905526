"""Progress words' sequence arithmetic (no GPU): what ``cuStreamWaitValue32``'s GEQ compares."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kernels.progress import landed, next_seq, progress_unavailable_reason


def test_a_word_says_landed_for_its_op_and_earlier_ones_only() -> None:
    assert landed(5, 5) and landed(5, 4) and not landed(5, 6)
    assert not landed(0, 1)  # a fresh word: no op of the copier has landed


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**31 - 1))
def test_wrap_around_keeps_the_order(seq: int, ahead: int) -> None:
    later = seq
    for _ in range(3):
        later = next_seq(later)
    word = (seq + ahead) & 0xFFFFFFFF
    assert landed(word, seq)
    assert landed(later, seq) and not landed(seq, later)


def test_the_probe_answers_without_raising() -> None:
    why = progress_unavailable_reason()
    assert why is None or (isinstance(why, str) and why)
