"""Where a decode step's time goes, at batch 1 or a batch of requests decoding together: the
compiled decoder stack's phases (``DecoderStack.set_timed``), the LM head, the sampler and the
rest of the step (scheduler, inputs, outputs, Python), each in ms per step and as a share of it,
beside the GB/s the stack's and the head's weights stream at and the GFLOP/s their matmuls run at
(used by ``bench_decode.py --split``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams


class _Timed:
    """Wraps ``owner.name`` (a callable attribute) to sum the seconds of its calls."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name
        self.inner: Callable = getattr(owner, name)
        self.seconds = 0.0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def restore(self) -> None:
        setattr(self.owner, self.name, self.inner)


def split_decode_steps(
    core: EngineCore,
    batch: list[list[int]],
    steps: int,
    stack_params: int,
    head_params: int,
    element: int,
) -> list[str]:
    """Lines of the split of ``steps`` greedy decode steps of the requests of ``batch`` (after
    every prompt's prefill), given the weights of the stack's and the head's matmuls and the
    bytes of a weight (``element``). Raises ValueError where the model runs no compiled stack
    (nothing to split)."""
    runner = core.executor.model_runner
    stack = getattr(runner.model.model, "_cpu_stack", None)
    if stack is None:
        raise ValueError("split: this engine runs no compiled decoder stack")
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i, prompt in enumerate(batch):
        core.add_request(EngineCoreRequest(f"split-{i}", prompt, params))
    first = 0
    while first < len(batch):  # the prefills, to every request's first token
        first += sum(len(o.new_token_ids) for o in core.step().outputs)
    timed = [_Timed(runner.model, "forward"), _Timed(runner.model, "compute_logits")]
    timed.append(_Timed(runner, "sampler"))
    stack.set_timed(True)
    start, count = time.perf_counter(), 0
    while core.has_unfinished_requests():
        core.step()
        count += 1
    total = time.perf_counter() - start
    stack.set_timed(False)
    for t in timed:
        t.restore()
    forward, head, sampler = (t.seconds for t in timed)
    phases = stack.phase_seconds()
    in_stack = sum(seconds for _, seconds in phases)
    parts = [(f"stack: {name}", seconds) for name, seconds in phases]
    parts += [
        ("forward outside the stack (embedding, final norm, Python)", forward - in_stack),
        ("LM head", head),
        ("sampler", sampler),
        ("rest of the step (scheduler, inputs, outputs)", total - forward - head - sampler),
    ]
    lines = [
        f"split of {count} decode steps of {len(batch)} request(s): "
        f"{1e3 * total / count:.2f} ms per step"
    ]
    lines += [
        f"  {name:58} {1e3 * seconds / count:7.3f} ms  {100 * seconds / total:5.1f}%"
        for name, seconds in parts
    ]
    matmuls = sum(s for n, s in phases if n in ("qkv", "o_proj", "gate_up", "down"))
    rows = len(batch)
    lines.append(
        f"  stack matmuls stream at {stack_params * element * count / matmuls / 1e9:.1f} GB/s "
        f"({2 * stack_params * rows * count / matmuls / 1e9:.0f} GFLOP/s), the LM head at "
        f"{head_params * element * count / head / 1e9:.1f} GB/s "
        f"({2 * head_params * rows * count / head / 1e9:.0f} GFLOP/s); outside the matmuls: "
        f"{100 * (total - matmuls - head) / total:.1f}% of the step"
    )
    return lines
