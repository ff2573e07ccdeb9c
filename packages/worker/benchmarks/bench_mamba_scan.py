"""The Mamba-2 scan's time per token: Ember's kernels against transformers' torch path.

The same random inputs, in float32 on the CPU, at a Bamba-9B mixer's head shape (128 heads of
64 channels, one group, a state of 128, chunks of 256), timed in the same run, interleaved:

- prefill: ``ember_kernels.mamba.ssd_chunk_scan_varlen`` over a flat batch against
  transformers' ``mamba2_chunk_scan`` (its torch fallback, no mamba_ssm) over the padded batch;
- decode: ``ember_kernels.mamba.selective_state_update`` against transformers'
  ``mamba2_selective_state_update`` (its torch fallback), one token for each of a batch.

Each figure is the median of ``--repeats`` runs after one warm-up. Figures from a loaded machine
are only indicative (see the worker README).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember_kernels.mamba import torch_ops

HEADS, HEAD_DIM, GROUPS, STATE, CHUNK = 128, 64, 1, 128, 256


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill(hf_scan, batch: int, length: int, repeats: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, length, HEADS, HEAD_DIM, generator=gen)
    dt = torch.randn(batch, length, HEADS, generator=gen)
    B = torch.randn(batch, length, GROUPS, STATE, generator=gen)
    C = torch.randn(batch, length, GROUPS, STATE, generator=gen)
    A = -torch.rand(HEADS, generator=gen) - 0.1
    D, dt_bias = torch.randn(HEADS, generator=gen), torch.randn(HEADS, generator=gen)
    states = torch.zeros(batch, HEADS, HEAD_DIM, STATE)
    slots = torch.arange(batch)
    qsl = torch.arange(batch + 1, dtype=torch.int32) * length
    fresh = torch.zeros(batch, dtype=torch.bool)

    def ember():
        torch_ops.ssd_chunk_scan_varlen(
            x.flatten(0, 1), dt.flatten(0, 1), A, B.flatten(0, 1), C.flatten(0, 1), D, dt_bias,
            states, slots, qsl, fresh, CHUNK,
        )  # fmt: skip

    def transformers():
        hf_scan(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True,
                return_final_states=True)  # fmt: skip

    tokens = batch * length
    return median_seconds(ember, repeats) / tokens, median_seconds(transformers, repeats) / tokens


def decode(hf_update, batch: int, repeats: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    dt = torch.randn(batch, HEADS, generator=gen)
    B = torch.randn(batch, GROUPS, STATE, generator=gen)
    C = torch.randn(batch, GROUPS, STATE, generator=gen)
    A = -torch.rand(HEADS, generator=gen) - 0.1
    D, dt_bias = torch.randn(HEADS, generator=gen), torch.randn(HEADS, generator=gen)
    ours = torch.randn(batch, HEADS, HEAD_DIM, STATE, generator=gen)
    theirs = ours.clone()
    slots = torch.arange(batch)

    def ember():
        torch_ops.selective_state_update(ours, x, dt, A, B, C, D, dt_bias, slots)

    # transformers' calling convention (BambaMixer): dt, A, D and dt_bias per channel.
    dt_p = dt[..., None].expand(-1, -1, HEAD_DIM)
    A_p = A[:, None, None].expand(-1, HEAD_DIM, STATE)
    D_p, bias_p = D[:, None].expand(-1, HEAD_DIM), dt_bias[:, None].expand(-1, HEAD_DIM)

    def transformers():
        hf_update(theirs, x, dt_p, A_p, B, C, D_p, z=None, dt_bias=bias_p, dt_softplus=True)

    return median_seconds(ember, repeats) / batch, median_seconds(transformers, repeats) / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-batch", type=int, default=2)
    parser.add_argument("--prefill-length", type=int, default=1024)
    parser.add_argument("--decode-batch", type=int, default=32)
    args = parser.parse_args()
    from transformers.models.bamba import modeling_bamba as hf

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
    print(f"heads {HEADS} x {HEAD_DIM}, state {STATE}, groups {GROUPS}, chunk {CHUNK}")
    ours, theirs = prefill(hf.mamba2_chunk_scan, args.prefill_batch, args.prefill_length,
                           args.repeats)  # fmt: skip
    print(f"prefill {args.prefill_batch} x {args.prefill_length}: ember {ours * 1e6:8.1f} us/token"
          f"  transformers {theirs * 1e6:8.1f} us/token  ({theirs / ours:.2f}x)")  # fmt: skip
    ours, theirs = decode(hf.mamba2_selective_state_update, args.decode_batch, args.repeats)
    print(f"decode batch {args.decode_batch}:   ember {ours * 1e6:8.1f} us/token"
          f"  transformers {theirs * 1e6:8.1f} us/token  ({theirs / ours:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
