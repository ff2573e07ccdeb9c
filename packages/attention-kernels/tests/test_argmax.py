"""``cpu_ops.argmax_rows``: greedy sampling's per-row argmax on float32 and bfloat16 logits, read
in place, against numpy's argmax of the same values widened to float32 (ties, signed zeros,
NaN, infinities, tails past the vector width, strided rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember_kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="needs the compiled CPU kernels")

DTYPES = [torch.float32, torch.bfloat16]


def numpy_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.argmax(logits.float().numpy(), axis=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 5, 31, 32, 33, 64, 95, 1000, 151936])
def test_random_rows_match_numpy(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(7, vocab, generator=gen) * 4).to(dtype)
    got = cpu_ops.argmax_rows(logits)
    assert got.dtype == torch.int64 and got.shape == (7,)
    assert torch.equal(got, numpy_argmax(logits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_signed_zeros_infinities_and_nan_follow_numpy(dtype):
    vocab = 100  # three full steps of 32 and a tail of 4
    rows = torch.full((10, vocab), -1.0)
    rows[0] = 2.0  # all equal: index 0
    rows[1, [70, 3, 40]] = 5.0  # the first of equal maxima, across steps and lanes
    rows[2, [17, 1]] = 5.0  # two lanes of one vector
    rows[3, [98, 99]] = 7.0  # maxima in the tail only
    rows[4] = -torch.inf  # nothing above -inf: index 0
    rows[5, 50], rows[5, 10] = 0.0, -0.0  # -0.0 == 0.0: the first one
    rows[6, 60], rows[6, 90], rows[6, 5] = torch.nan, torch.nan, 3.0  # the first NaN
    rows[7, 97] = torch.nan  # a NaN in the tail
    rows[8, 33] = torch.inf
    rows[9, 0] = torch.nan
    logits = rows.to(dtype)
    assert torch.equal(cpu_ops.argmax_rows(logits), numpy_argmax(logits))
    assert cpu_ops.argmax_rows(logits).tolist() == [0, 3, 1, 98, 0, 10, 60, 97, 33, 0]


def test_strided_rows_are_read_in_place_and_other_dtypes_refused():
    wide = torch.randn(4, 300).bfloat16()
    view = wide[:, 40:240]
    assert torch.equal(cpu_ops.argmax_rows(view), numpy_argmax(view))
    with pytest.raises(ValueError, match="logits: float32 or bfloat16"):
        cpu_ops.argmax_rows(torch.randn(2, 8).half())
