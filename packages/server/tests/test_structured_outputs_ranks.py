"""Structured outputs with the ranks in worker processes: the ranks that sample compile each
grammar once, where their matchers use it; the engine process builds no grammar compiler."""

import json

import jsonschema
import pytest
from structured_cases import CHOICES, SCHEMAS

from ember_scheduler import EngineCoreRequest, SamplingParams, StructuredOutputsParams
from ember_server import LLM
from ember_worker.distributed.grammar_proxy import RankGrammarCompiler
from ember_worker.structured_outputs import XGrammarCompiler

PROMPTS = ["def parse(self, text):", "import os", "class Foo:"]
SETTINGS = dict(kv_cache_memory=16 * 1024**2, max_model_len=512, dtype="float32")


def _specs() -> list[StructuredOutputsParams]:
    return [StructuredOutputsParams(json=schema) for schema in SCHEMAS[:4]] + [
        StructuredOutputsParams(choice=CHOICES[0])
    ]


def _greedy(spec: StructuredOutputsParams) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=spec)


def _generate(llm: LLM, specs) -> list:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(specs))]
    outputs = llm.generate(prompts, [_greedy(spec) for spec in specs], use_tqdm=False)
    return [output.outputs[0] for output in outputs]


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"pipeline_parallel_size": 2}, id="pp2"),
        pytest.param({"tensor_parallel_size": 2}, id="tp2", marks=pytest.mark.slow),
        pytest.param(
            {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
            id="tp2-ray",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_ranks_compile_the_grammars_and_outputs_match_one_rank(layout, tiny_model, monkeypatch):
    model = str(tiny_model("llama"))
    one_rank = LLM(model, **SETTINGS)
    specs = _specs()
    expected = [output.token_ids for output in _generate(one_rank, specs)]
    one_rank.shutdown()

    def no_compiler_here(*args, **kwargs):
        raise AssertionError("the engine process built a grammar compiler")

    # The offline engine core runs in this process; the ranks are processes of their own.
    monkeypatch.setattr(XGrammarCompiler, "__init__", no_compiler_here)
    llm = LLM(model, **{"distributed_executor_backend": "mp", **SETTINGS, **layout})
    try:
        assert isinstance(llm.engine_core.executor.grammar_compiler, RankGrammarCompiler)
        outputs = _generate(llm, specs)
        assert [output.token_ids for output in outputs] == expected
        for output, spec in zip(outputs, specs):
            if spec.json is not None and output.finish_reason == "stop":
                jsonschema.validate(json.loads(output.text), spec.json)
            elif spec.choice is not None:
                assert output.text in spec.choice
        # A spec that reaches the engine core unchecked fails on the ranks: its request is
        # aborted with their reason, and the engine keeps serving.
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a|b"))
        core = llm.engine_core
        core.add_request(EngineCoreRequest("bad", [1, 5, 6], bad, eos_token_id=2))
        finished = []
        while core.has_unfinished_requests():
            finished += core.step().outputs
        (final,) = [o for o in finished if o.request_id == "bad"]
        assert str(final.finish_reason) == "abort" and "regex is invalid" in final.finish_detail
        prompt = PROMPTS[(len(specs) - 1) % len(PROMPTS)]  # the last spec's, as in the batch
        [again] = llm.generate(prompt, _greedy(specs[-1]), use_tqdm=False)
        assert again.outputs[0].token_ids == expected[-1]
    finally:
        llm.shutdown()
