"""InputProcessor, the one owner of the request rules the offline API and the HTTP routes share:
tokenization and chat rendering, token ids, the length limit, structured-output specs."""

import pytest

from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import SamplingParams
from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_server.engine.input_processor import TokenizedPrompt
from ember_server.openai.protocol_chat import ChatCompletionRequest
from ember_server.openai.protocol_completion import CompletionRequest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}


def test_a_conversation_is_rendered_once(tokenizer, inputs, monkeypatch):
    calls = []
    render = tokenizer.apply_chat_template

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counting)
    prompt = inputs.tokenize_chat(MESSAGES, add_generation_prompt=True)
    assert len(calls) == 1
    expected = render(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == TokenizedPrompt(expected, tokenizer.encode(expected, add_special_tokens=False))


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([], "at least one message"),
        ([{"role": "user"}], r"messages\[0\] must be a dict with 'role' and 'content'"),
        (["hi"], r"messages\[0\]"),
    ],
)
def test_bad_conversations_are_refused(inputs, messages, words):
    with pytest.raises(ValueError, match=words):
        inputs.tokenize_chat(messages, add_generation_prompt=True)


def test_a_tokenized_prompt_passes_through_unchecked(inputs):
    prompt = inputs.tokenize("hello")
    assert inputs.tokenize(prompt) is prompt
    assert prompt.text == "hello" and prompt.token_ids[0] == 1  # BOS first


def test_prompt_text_and_token_ids_share_one_set_of_rules(inputs):
    with pytest.raises(ValueError, match=r"^prompt must not be empty$"):
        inputs.tokenize("")  # the Python API's own rule: an empty string is a mistake
    with pytest.raises(ValueError, match=r"prompt must not be empty \(it has no tokens\)"):
        inputs.tokenize_text("", add_special_tokens=False)
    assert inputs.tokenize_text("", add_special_tokens=True).token_ids == [1]  # BOS alone
    with pytest.raises(ValueError, match=r"input must not be empty \(it has no tokens\)"):
        inputs.tokenize_ids([], "input")
    with pytest.raises(ValueError, match="characters long"):
        inputs.tokenize_text("a" * (64 * inputs.text_encoder.chars_per_token + 1))


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ([1, -2, 3, 10**6], r"holds token ids outside the vocabulary \[0, \d+\): \[-2, 1000000\]"),
        (
            [1, 2**70],
            r"holds token ids outside the vocabulary \[0, \d+\): \[1180591620717411303424\]",
        ),
        ([1.0, 2.0], "must be a flat list of integers"),
        ([[1], [2]], "must be a flat list of integers"),
        ("12", "must be a flat list of integers"),
    ],
)
def test_token_ids_are_checked_in_one_place(inputs, token_ids, message):
    with pytest.raises(ValueError, match=f"^tokens {message}"):
        inputs.check_token_ids(token_ids, "tokens")


def test_one_length_limit_for_generation_and_pooling(inputs):
    assert inputs.max_num_tokens == 40  # the KV cache binds before max_model_len (64)
    assert inputs.output_room(39) == 1
    with pytest.raises(ValueError, match="KV cache holds 40 tokens"):
        inputs.make_requests("g", [5] * 40, SamplingParams())
    assert inputs.make_pooling_request("p", [5] * 40, PoolingParams())
    with pytest.raises(ValueError, match="maximum input length is 40 tokens"):
        inputs.make_pooling_request("p", [5] * 41, PoolingParams())
    inputs.max_num_kv_tokens = None
    assert inputs.max_num_tokens == 64


def test_a_structured_output_spec_is_parsed_by_the_input_processor_alone(inputs):
    # The HTTP models only build the spec (its shape); whether it parses is checked once, when
    # the request is made, and the route names the field it came from.
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": BAD_SCHEMA},
            },
        }
    )
    assert chat.structured_field == "response_format"
    completion = CompletionRequest.model_validate(
        {"prompt": "x", "structured_outputs": {"regex": "(a|b"}}
    )
    assert completion.structured_field == "structured_outputs"
    for request in (chat, completion):
        params = request.to_sampling_params(4)
        with pytest.raises(
            ValueError, match=r"^SamplingParams\.structured_outputs\.\w+ is invalid"
        ):
            inputs.make_requests("r", [5, 6], params)
    good = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert inputs.make_requests("r", [5, 6], good)
