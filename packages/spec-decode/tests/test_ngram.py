import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember_spec_decode import NgramProposer


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Per-row definition: longest n first, earliest earlier occurrence, up to k tokens after."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose(rows: list[list[int]], min_n: int, max_n: int, k: int) -> list[list[int]]:
    width = max(len(r) for r in rows) + 3
    token_ids = np.full((len(rows), width), 7777, dtype=np.int32)  # padding must never match
    for i, row in enumerate(rows):
        token_ids[i, : len(row)] = row
    lengths = np.array([len(r) for r in rows])
    return NgramProposer(min_n, max_n, k).propose(token_ids, lengths).to_lists()


def test_examples():
    assert propose([[1, 2, 3, 4, 1, 2, 3]], 2, 3, 4) == [[4, 1, 2, 3]]
    assert propose([[1, 2, 3, 4, 2, 3]], 2, 2, 4) == [[4, 2, 3]]  # fewer than k follow
    assert propose([[1, 2, 3, 4, 5]], 1, 3, 4) == [[]]  # no earlier occurrence
    # the longest n wins over an earlier, shorter match: [9, 2] matches at 3, [2] alone at 0
    assert propose([[2, 5, 6, 9, 2, 8, 1, 9, 2]], 1, 2, 2) == [[8, 1]]
    # the earliest of equal matches: [5] occurs at 0 and 2
    assert propose([[5, 1, 5, 2, 5]], 1, 1, 1) == [[1]]
    # a row of length 0 (not proposing) and a period-1 loop
    assert propose([[], [3, 3, 3, 3]], 1, 2, 3) == [[], [3, 3]]


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(1, 5),
)
def test_matches_the_per_row_definition(rows, min_n, extra, k):
    if not any(rows):
        rows = [*rows, [0]]
    assert propose(rows, min_n, min_n + extra, k) == [
        reference(r, min_n, min_n + extra, k) for r in rows
    ]


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2, 4)
    with pytest.raises(ValueError, match="k"):
        NgramProposer(1, 2, 0)
