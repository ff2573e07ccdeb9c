"""Structured outputs through the offline API on a random-weight model: every output is valid."""

import json

import jsonschema
import pytest
from structured_cases import CHOICES, REGEXES, SCHEMAS, matches_regex

from ember_scheduler import SamplingParams, StructuredOutputsParams
from ember_server.engine.llm import LLM

PROMPTS = ["def parse(self, text):", "Grüße aus Köln", "import os", "class Foo:"]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(
        str(tiny_model("llama")), dtype="float32", kv_cache_memory=16 * 1024**2, max_model_len=1024
    )
    yield engine
    engine.shutdown()


def _params(spec: StructuredOutputsParams, index: int) -> SamplingParams:
    """Greedy and seeded random sampling alternate, so both paths meet every grammar."""
    return SamplingParams(
        temperature=0.0 if index % 2 else 1.0,
        seed=index,
        max_tokens=MAX_TOKENS,
        structured_outputs=spec,
    )


def _generate(llm, specs):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(specs))]
    params = [_params(spec, i) for i, spec in enumerate(specs)]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("compact", [False, True], ids=["whitespace", "compact"])
def test_every_json_schema_output_parses_and_validates(llm, compact):
    specs = [StructuredOutputsParams(json=s, disable_any_whitespace=compact) for s in SCHEMAS]
    for schema, output in zip(SCHEMAS, _generate(llm, specs)):
        assert output.finish_reason == "stop", (schema, output.text)
        jsonschema.validate(json.loads(output.text), schema)


def test_a_schema_given_as_a_json_string(llm):
    (output,) = _generate(llm, [StructuredOutputsParams(json=json.dumps(SCHEMAS[0]))])
    jsonschema.validate(json.loads(output.text), SCHEMAS[0])


def test_json_object_outputs_are_objects_or_cut_by_max_tokens(llm):
    """Any JSON object has no bound on its strings, which random weights may never close: such
    an output ends with ``length`` at ``max_tokens``; every other one parses."""
    specs = [
        StructuredOutputsParams(json_object=True, disable_any_whitespace=i % 2 == 0)
        for i in range(8)
    ]
    outputs = _generate(llm, specs)
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert stopped
    for output in stopped:
        assert isinstance(json.loads(output.text), dict)
    for output in outputs:
        assert output in stopped or len(output.token_ids) == MAX_TOKENS


def test_regexes_and_choices(llm):
    names = list(REGEXES) * 3
    specs = [StructuredOutputsParams(regex=REGEXES[name]) for name in names]
    for name, output in zip(names, _generate(llm, specs)):
        assert output.finish_reason == "stop"
        assert matches_regex(name, output.text), (name, output.text)
    specs = [StructuredOutputsParams(choice=choices) for choices in CHOICES * 3]
    for choices, output in zip(CHOICES * 3, _generate(llm, specs)):
        assert output.text in choices


def test_an_ebnf_grammar(llm):
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] " + " [0-9]'
    for output in _generate(llm, [StructuredOutputsParams(grammar=grammar)] * 4):
        assert output.text[0] == "(" and output.text[-1] == ")" and output.finish_reason == "stop"


def test_chat_with_a_schema(llm):
    params = _params(StructuredOutputsParams(json=SCHEMAS[5]), 1)
    output = llm.chat([{"role": "user", "content": "where?"}], params, use_tqdm=False)
    jsonschema.validate(json.loads(output[0].outputs[0].text), SCHEMAS[5])


def test_free_requests_are_untouched_by_constrained_neighbours(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    constrained = [
        _params(StructuredOutputsParams(json=schema), i) for i, schema in enumerate(SCHEMAS[:6])
    ]
    mixed = llm.generate(
        PROMPTS + PROMPTS[:2] * 3, [free] * len(PROMPTS) + constrained, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in mixed[: len(PROMPTS)]] == alone
    for schema, output in zip(SCHEMAS, mixed[len(PROMPTS) :]):
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_a_grammar_cut_by_max_tokens_ends_with_length(llm):
    spec = StructuredOutputsParams(json=SCHEMAS[4])
    params = SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=spec)
    output = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 3


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
            "json",
        ),
        (StructuredOutputsParams(regex="(a|b"), "regex"),
        (StructuredOutputsParams(grammar='root ::= "a" rest'), "grammar"),
    ],
)
def test_bad_specs_are_refused_before_the_engine_and_it_keeps_serving(llm, spec, field):
    params = SamplingParams(structured_outputs=spec)
    with pytest.raises(ValueError, match=f"SamplingParams.structured_outputs.{field} is invalid"):
        llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()
    ok = SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["x"])
    )
    assert llm.generate(PROMPTS[0], ok, use_tqdm=False)[0].outputs[0].text == "x"


def test_a_grammar_failing_inside_the_engine_aborts_only_its_request(llm):
    """A spec that slips past the front end (here: handed straight to the engine core) ends as
    its request's error; the engine keeps serving."""
    from ember_scheduler import EngineCoreRequest

    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a|b"))
    core = llm.engine_core
    core.add_request(EngineCoreRequest("bad", [1, 5, 6], bad, eos_token_id=2))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step().outputs
    (final,) = [o for o in outputs if o.request_id == "bad"]
    assert str(final.finish_reason) == "abort" and "regex is invalid" in final.finish_detail
    ok = SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["x"])
    )
    assert llm.generate(PROMPTS[0], ok, use_tqdm=False)[0].outputs[0].text == "x"


@pytest.mark.slow
def test_preempted_constrained_requests_resume_their_grammar(tiny_model):
    """A cache too small for the batch preempts requests; on resume each matcher replays the
    outputs so far, and every output still validates."""
    from ember_scheduler import EngineCoreRequest

    # 11 blocks of 16 tokens: room for one sequence of the longest context, not for the batch.
    llm = LLM(
        str(tiny_model("llama")), dtype="float32", kv_cache_memory=96 * 1024, max_model_len=176
    )
    try:
        core, tokenizer = llm.engine_core, llm.get_tokenizer()
        for i, schema in enumerate(SCHEMAS):
            params = _params(StructuredOutputsParams(json=schema), i)
            prompt = tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids
            core.add_request(EngineCoreRequest(str(i), prompt, params, eos_token_id=2))
        tokens, reasons, preemptions = {}, {}, 0
        while core.has_unfinished_requests():
            step = core.step()
            preemptions += step.scheduler_stats.num_preemptions
            for out in step.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                reasons[out.request_id] = out.finish_reason
    finally:
        llm.shutdown()
    assert preemptions > 0
    for i, schema in enumerate(SCHEMAS):
        assert str(reasons[str(i)]) == "stop"
        text = tokenizer.decode(tokens[str(i)], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)
