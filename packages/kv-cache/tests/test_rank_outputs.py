"""Combining the connector outputs of tensor-parallel ranks."""

from __future__ import annotations

import pytest

from ember_kv_cache import KVConnectorOutput
from ember_kv_cache.rank_outputs import RankOutputCombiner


def out(loading=None, saving=()):
    return KVConnectorOutput(dict(loading or {}), list(saving))


def test_a_load_finishes_when_every_rank_has_it_with_the_fewest_tokens():
    combiner = RankOutputCombiner(2)
    # Rank 1 finishes "a" a step later, with fewer tokens (a chunk missing on its tier).
    first = combiner.combine([out({"a": 48, "b": 32}), out({"b": 32})])
    assert first.finished_loading == {"b": 32}
    assert combiner.combine([None, out({"a": 16})]).finished_loading == {"a": 16}
    assert combiner.combine([out(), out()]).finished_loading == {}


def test_a_save_finishes_when_every_rank_reports_it():
    combiner = RankOutputCombiner(3)
    assert combiner.combine([out(saving=["r"]), out(saving=["r"]), out()]).finished_saving == []
    assert combiner.combine([out(), out(), out(saving=["r", "s"])]).finished_saving == ["r"]
    assert combiner.combine([out(saving=["s"]), out(saving=["s"]), None]).finished_saving == ["s"]


def test_one_rank_passes_its_output_through_and_bad_counts_are_errors():
    combiner = RankOutputCombiner(1)
    assert combiner.combine([out({"a": 8}, ["b"])]) == out({"a": 8}, ["b"])
    with pytest.raises(ValueError, match="expected 1 rank outputs"):
        combiner.combine([out(), out()])
    with pytest.raises(ValueError, match="num_ranks"):
        RankOutputCombiner(0)
