"""The README's example engine runs and reports prefix-cache reuse."""

import pathlib
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "paged_numpy_store.py"


def test_paged_numpy_store_example_runs():
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, check=True, timeout=60
    )
    assert "req-1: reused 12 of 16 prompt tokens" in result.stdout
    assert "prefix-cache hit rate: 56.2% (36 of 64 prompt tokens)" in result.stdout


def test_tiered_numpy_store_example_shares_chunks_between_engines():
    example = EXAMPLE.with_name("tiered_numpy_store.py")
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, check=True, timeout=60
    )
    assert "engine A computed 300 of 300 tokens" in result.stdout
    assert "engine B computed 44 of 300 tokens, loaded 4 chunks" in result.stdout


def test_hybrid_numpy_store_example_keeps_the_window_group_flat():
    example = EXAMPLE.with_name("hybrid_numpy_store.py")
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, check=True, timeout=60
    )
    assert "80 tokens: window group holds 4 blocks, global 20" in result.stdout
    assert "20 tokens: window group holds 4 blocks, global 5" in result.stdout
    assert "all blocks free again: True" in result.stdout


def test_state_numpy_store_example_keeps_one_state_block_per_request():
    example = EXAMPLE.with_name("state_numpy_store.py")
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, check=True, timeout=60
    )
    assert "40 tokens: state group holds 1 block, attention 10" in result.stdout
    assert "state after recompute equals the running one: True" in result.stdout
    assert "all blocks free again: True" in result.stdout
