"""Where a batched step of the Qwen2.5-0.5B shape spends its time, by part, with each
projection's GFLOP/s: a prefill step of ``--batch`` prompts and the decode steps after it.

The model and engine are ``bench_decode``'s (random weights, Qwen2.5-0.5B shapes, ``--dtype``).
The split comes from the per-operation path (the compiled decoder stack runs the same kernels
and matmuls from C++, where no timer reaches), each module timed around its call and the time of
its timed children taken from its own:

- the four projections of every layer and the LM head (on each request's last token);
- attention (the KV cache write and ``ember_kernels.paged_attention``), rotary embedding, the
  RMSNorms, the MLP's own time (SiLU-and-mul), the attention block's own (splits and reshapes);
- sampling (``Sampler``), input preparation (the batch update and ``ModelInputBuffers``), and
  the rest of the engine step (scheduler, output processing).

Then the same steps on the compiled stack, whole (forward, head, the rest). With one thread
(``--threads 1``, the default) the clock is the thread's CPU time, which other processes on the
machine inflate far less than wall time (their cache and memory traffic still counts); with more
threads it is wall time.

    python3 packages/worker/benchmarks/bench_step_profile.py [--batch 32] [--steps 12]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from bench_decode import BATCH, PROMPT, QWEN_05B, make_engine, prompts

from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
TIMED = (*PROJECTIONS, "attn", "rotary_emb", "input_layernorm", "post_attention_layernorm",
         "norm", "self_attn", "mlp", "embed_tokens")  # fmt: skip
PARENTS = ("self_attn", "mlp")  # reported by their own time, their timed children taken out


class PartTimer:
    """Accumulates each part's time; a part's timed children are charged to them, not to it."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.total: collections.Counter[str] = collections.Counter()
        self.open: list[tuple[str, float]] = []

    def start(self, part: str) -> None:
        self.open.append((part, self.clock()))

    def stop(self) -> None:
        part, began = self.open.pop()
        elapsed = self.clock() - began
        self.total[part] += elapsed
        if self.open:
            self.total[self.open[-1][0] + " children"] += elapsed

    def own(self, part: str) -> float:
        return self.total[part] - self.total[part + " children"]

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            self.start(part)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop()

        setattr(owner, name, timed)


def instrument(core, timer: PartTimer) -> None:
    runner = core.executor.worker.model_runner
    for name, module in runner.model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf in TIMED:
            part = "norms" if leaf.endswith("norm") else leaf
            module.register_forward_pre_hook(lambda m, a, part=part: timer.start(part))
            module.register_forward_hook(lambda m, a, o: timer.stop())
    timer.wrap(runner.model, "compute_logits", "lm_head")
    timer.wrap(runner, "sampler", "sampler")
    timer.wrap(runner, "_update_states", "input prep")
    timer.wrap(runner.input_buffers, "prepare", "input prep")
    timer.wrap(runner.model, "forward", "forward")


def run_steps(
    core, timer: PartTimer, batch: int, steps: int, tag: str, seed: int
) -> dict[str, dict[str, float]]:
    """Seconds per part of the prefill step and, averaged, of ``steps`` decode steps (prompts
    from ``seed``: a run's own, or the prefix cache would skip their prefill)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts(batch, seed)):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params))
    result = {}
    for phase, count in (("prefill", 1), ("decode", steps)):
        timer.total.clear()
        began = timer.clock()
        for _ in range(count):
            core.step()
        parts = {key: value / count for key, value in timer.total.items()}
        parts["step"] = (timer.clock() - began) / count
        parts.update({p: timer.own(p) / count for p in PARENTS})
        result[phase] = parts
    while core.has_unfinished_requests():
        core.step()
    return result


def print_split(phase: str, parts: dict[str, float], tokens: int, logit_rows: int) -> None:
    c = QWEN_05B
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * 64, c["num_key_value_heads"] * 64
    weights = {"qkv_proj": (q + 2 * kv) * hidden, "o_proj": hidden * q,
               "gate_up_proj": 2 * inter * hidden, "down_proj": hidden * inter}  # fmt: skip
    flops = {p: 2 * tokens * n * layers for p, n in weights.items()}
    flops["lm_head"] = 2 * logit_rows * c["vocab_size"] * hidden
    step = parts["step"]
    rows = [(p, parts.get(p, 0.0)) for p in (*PROJECTIONS, "lm_head")]
    rows += [("attention (cache write + paged)", parts.get("attn", 0.0)),
             ("rotary", parts.get("rotary_emb", 0.0)), ("rms norms", parts.get("norms", 0.0)),
             ("mlp own (silu_and_mul)", parts["mlp"]),
             ("attention block own (split/reshape)", parts["self_attn"]),
             ("embedding", parts.get("embed_tokens", 0.0)), ("sampler", parts.get("sampler", 0.0)),
             ("input prep", parts.get("input prep", 0.0))]  # fmt: skip
    rows.append(("rest of the step", step - sum(t for _, t in rows)))
    print(f"{phase}: {tokens} tokens, step {step * 1e3:.1f} ms")
    for name, seconds in rows:
        rate = f"{flops[name] / seconds / 1e9:7.1f} GFLOP/s" if name in flops and seconds else ""
        print(f"  {name:38}{seconds * 1e3:9.2f} ms {seconds / step:6.1%}  {rate}")
    matmul = sum(parts.get(p, 0.0) for p in flops)
    print(f"  {'matmuls together':38}{matmul * 1e3:9.2f} ms {matmul / step:6.1%}  "
          f"{sum(flops.values()) / matmul / 1e9:7.1f} GFLOP/s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    core = make_engine(args.dtype, args.threads)
    timer = PartTimer(clock)
    instrument(core, timer)
    decoder = core.executor.worker.model_runner.model.model
    print(f"{args.dtype}, {args.threads} thread(s), clock {clock.__name__}, batch {args.batch}")
    run_steps(core, timer, 2, 2, "warmup", seed=1)
    decoder.use_cpu_stack = False
    split = run_steps(core, timer, args.batch, args.steps, "ops", seed=2)
    print_split("prefill", split["prefill"], args.batch * PROMPT, args.batch)
    print_split("decode", split["decode"], args.batch, args.batch)
    decoder.use_cpu_stack = True
    run_steps(core, timer, 2, 2, "warmup-stack", seed=3)
    whole = run_steps(core, timer, args.batch, args.steps, "stack", seed=4)
    print("compiled stack, whole:")
    for phase, parts in whole.items():
        step, forward, head = parts["step"], parts["forward"], parts["lm_head"]
        print(f"  {phase:8} step {step * 1e3:8.1f} ms  decoder {forward * 1e3:8.1f} ms  "
              f"LM head {head * 1e3:6.1f} ms  rest {(step - forward - head) * 1e3:6.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
