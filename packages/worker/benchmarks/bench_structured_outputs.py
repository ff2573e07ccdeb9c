"""Structured-output costs on the CPU, against unconstrained decoding in the same engine.

On the ~30M Llama of ``bench_throughput.py`` (float32, one torch thread, the tiny byte-level BPE
tokenizer: 2048 tokens, so a bitmask row is 64 words where a 128k vocabulary needs 4000), at
batch 1, 16 and 64:

  step:    mean decode-step time with every request under a JSON schema (a bitmask filled and
           applied per row, matchers advanced) / the same requests unconstrained (the baseline);
           ``mask ms`` is the grammar work alone per step (fill + apply + accept), and
           ``mask/free`` its share of an unconstrained step (steadier than the ratio of two
           whole-step times on a busy machine);
  compile: one spec compiled cold (a spec the cache has not seen) and cached (the same spec
           again), per schema size;
  ttft:    time from submitting ``batch`` requests with a fresh schema (compiled on the way) to
           the last of their first tokens, against the same requests unconstrained.

    python3 packages/worker/benchmarks/bench_structured_outputs.py
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from bench_throughput import make_engine, model_path

from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_worker.structured_outputs import GrammarMatchers, XGrammarCompiler

EOS = 2
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
# A long bounded string: every row stays constrained for the whole measured window.
LONG = {"type": "string", "minLength": 600, "maxLength": 600}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age"],
}
SCHEMAS = {
    "small": PERSON,
    "medium": {"type": "object", "properties": {f"p{i}": PERSON for i in range(10)}},
    "large": {
        "$defs": {"person": PERSON},
        "type": "object",
        "properties": {
            f"group{i}": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 5}
            for i in range(60)
        },
    },
}
_ids = itertools.count()


def _submit(core, batch: int, spec: StructuredOutputsParams | None, max_tokens: int) -> list[str]:
    ids = []
    for _ in range(batch):
        req_id = f"r{next(_ids)}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec)
        core.add_request(EngineCoreRequest(req_id, PROMPT, params, eos_token_id=EOS))
        ids.append(req_id)
    return ids


def _drain(core) -> None:
    core.abort_requests(list(core.scheduler.requests))
    while core.has_unfinished_requests():
        core.step()


class _MaskTimer:
    """Adds up the time the model runner spends in its grammar matchers."""

    def __init__(self, matchers: GrammarMatchers) -> None:
        self.seconds = 0.0
        for name in ("apply_bitmask", "accept_sampled"):
            method = getattr(matchers, name)
            setattr(matchers, name, self._timed(method))

    def _timed(self, method):
        def run(*args):
            start = time.perf_counter()
            method(*args)
            self.seconds += time.perf_counter() - start

        return run


def step_times(core, batch: int, constrained: bool, steps: int, timer: _MaskTimer):
    """Mean seconds per decode step once every request has its first token, and of that the
    seconds in the grammar matchers."""
    spec = StructuredOutputsParams(json=LONG, disable_any_whitespace=True) if constrained else None
    ids = _submit(core, batch, spec, steps + 8)
    while any(not core.scheduler.requests[i].output_token_ids for i in ids):
        core.step()
    timer.seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    elapsed = (time.perf_counter() - start) / steps
    assert all(i in core.scheduler.requests for i in ids), "a request finished inside the window"
    _drain(core)
    return elapsed, timer.seconds / steps


def ttft(core, batch: int, spec: StructuredOutputsParams | None) -> float:
    start = time.perf_counter()
    ids = set(_submit(core, batch, spec, 4))
    while ids:
        for output in core.step().outputs:
            if output.new_token_ids:
                ids.discard(output.request_id)
    elapsed = time.perf_counter() - start
    _drain(core)
    return elapsed


def compile_times(compiler: XGrammarCompiler, rounds: int) -> dict[str, tuple[float, float]]:
    result = {}
    for name, schema in SCHEMAS.items():
        cold, cached = [], []
        for round_ in range(rounds):
            # A title the cache has not seen makes the spec new without changing its grammar.
            spec = StructuredOutputsParams(json={**schema, "title": f"{name}{round_}"})
            start = time.perf_counter()
            compiler.compile(spec).result()
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            compiler.compile(StructuredOutputsParams(json=spec.json)).result()
            cached.append(time.perf_counter() - start)
        result[name] = (statistics.median(cold), statistics.median(cached))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    parser.add_argument("--rounds", type=int, default=5, help="compiles per schema size")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per figure")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    base = make_engine(max(batches), 700)
    executor = base.executor
    # The engine core as the server's factory builds it: with the executor's grammar compiler.
    core = EngineCore(executor, base.scheduler.config, executor.grammar_compiler)
    start = time.perf_counter()
    executor.grammar_compiler.compile(StructuredOutputsParams(choice=["warm"])).result()
    print(
        f"model: {model_path().name}, vocab {executor.grammar_compiler.vocab_size}; first "
        f"compile done {(time.perf_counter() - start) * 1e3:.0f} ms after the model loaded "
        "(the tokenizer info is built meanwhile)"
    )
    timer = _MaskTimer(executor.model_runner.grammar_matchers)
    step_times(core, 2, True, 2, timer)  # first-call costs out of the timings

    # Medians of interleaved runs: the machine is shared, so a slow moment hits both sides.
    print(
        f"{'batch':>5}{'free ms/step':>14}{'schema ms/step':>16}{'ratio':>8}{'mask ms':>9}"
        f"{'mask/free':>11}"
    )
    for batch in batches:
        runs = [
            (
                step_times(core, batch, False, args.steps, timer)[0],
                *step_times(core, batch, True, args.steps, timer),
            )
            for _ in range(args.repeats)
        ]
        free, constrained, mask = (statistics.median(column) for column in zip(*runs))
        print(
            f"{batch:>5}{free * 1e3:>14.2f}{constrained * 1e3:>16.2f}"
            f"{constrained / free:>7.2f}x{mask * 1e3:>9.2f}{mask / free:>10.1%}"
        )

    print(f"{'schema':>8}{'cold ms':>10}{'cached ms':>11}")
    for name, (cold, cached) in compile_times(executor.grammar_compiler, args.rounds).items():
        print(f"{name:>8}{cold * 1e3:>10.2f}{cached * 1e3:>11.4f}")

    print(f"{'batch':>5}{'free ttft ms':>14}{'schema ttft ms':>16}{'ratio':>8}")
    for batch in batches:
        runs = []
        for round_ in range(args.repeats):
            title = f"ttft{batch}-{round_}"  # a fresh spec: its compile is part of the wait
            spec = StructuredOutputsParams(json={**SCHEMAS["medium"], "title": title})
            runs.append((ttft(core, batch, None), ttft(core, batch, spec)))
        free, constrained = (statistics.median(column) for column in zip(*runs))
        print(f"{batch:>5}{free * 1e3:>14.1f}{constrained * 1e3:>16.1f}{constrained / free:>7.2f}x")


if __name__ == "__main__":
    main()
