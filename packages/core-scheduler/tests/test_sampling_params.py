import msgspec
import pytest

from ember_scheduler import SamplingParams


def test_defaults_are_valid_and_match_the_openai_api():
    params = SamplingParams()
    assert (params.n, params.max_tokens, params.temperature, params.top_p) == (1, 16, 1.0, 1.0)
    assert params.top_k == 0 and params.stop == [] and not params.ignore_eos
    assert not params.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("n", 0, "[1, 2147483647]"),
        ("n", 2**31, "2147483647]"),
        ("seed", 2**63, "9223372036854775807]"),
        ("seed", -(2**63) - 1, "[-9223372036854775808,"),
        ("max_tokens", 0, "[1, 2147483647]"),
        ("max_tokens", 2**31, "[1, 2147483647]"),
        ("min_tokens", -1, "[0, 2147483647]"),
        ("temperature", -0.1, "[0, 100]"),
        ("temperature", 101.0, "[0, 100]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, "[-1, 2147483647]"),
        ("top_k", 2**31, "[-1, 2147483647]"),
        ("min_p", 1.5, "[0, 1]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3.0, "[-2, 2]"),
        ("repetition_penalty", 0.0, "(0, 10]"),
        ("logprobs", 21, "[0, 20]"),
        ("prompt_logprobs", -1, "[0, 20]"),
        ("stop", [""], "non-empty strings"),
        ("stop_token_ids", [-1], "[0, 2147483647]"),
        ("stop_token_ids", [2**31], "[0, 2147483647]"),
    ],
)
def test_out_of_range_values_name_the_field_and_the_range(field, value, words):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} ") as info:
        SamplingParams(**{field: value})
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("max_tokens", "10", "an int or None, got str '10'"),
        ("min_tokens", 1.0, "an int, got float"),
        ("n", True, "an int, got bool"),
        ("seed", 2.5, "an int or None, got float"),
        ("logprobs", "1", "an int or None, got str"),
        ("temperature", "0.5", "a float, got str '0.5'"),
        ("top_p", None, "a float, got NoneType"),
        ("presence_penalty", True, "a float, got bool"),
        ("ignore_eos", 1, "a bool, got int"),
        ("stop", [1], "a string or a list of strings"),
        ("stop", None, "a string or a list of strings"),
        ("stop_token_ids", [1.0], "a list of ints"),
        ("stop_token_ids", (1, 2), "a list of ints"),
    ],
)
def test_wrong_types_name_the_field_and_the_expected_type(field, value, expected):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be ") as info:
        SamplingParams(**{field: value})
    assert expected in str(info.value)


def test_an_int_passes_as_a_float_and_becomes_one():
    params = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert isinstance(params.temperature, float) and params.repetition_penalty == 2.0


def test_counts_are_bounded_to_what_the_engine_holds_even_without_max_tokens():
    # min_tokens lives in an int32 column of the worker's batch.
    with pytest.raises(
        ValueError, match=r"SamplingParams\.min_tokens must be in \[0, 2147483647\]"
    ):
        SamplingParams(min_tokens=2**40, max_tokens=None)
    assert SamplingParams(min_tokens=2**31 - 1, max_tokens=None).min_tokens == 2**31 - 1


def test_decoding_validates_too():
    data = msgspec.msgpack.encode(SamplingParams(min_tokens=3, max_tokens=None))
    bad = data.replace(msgspec.msgpack.encode(3), msgspec.msgpack.encode(2**40), 1)
    with pytest.raises(msgspec.ValidationError, match="min_tokens"):
        msgspec.msgpack.decode(bad, type=SamplingParams)


def test_min_tokens_may_not_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_normalisations():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(top_k=-1).top_k == 0


def test_round_trips_through_msgpack_and_clone_revalidates():
    params = SamplingParams(temperature=0.5, stop=["a"], stop_token_ids=[3], seed=7, logprobs=2)
    data = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(data, type=SamplingParams) == params
    assert params.clone(seed=8).seed == 8
    with pytest.raises(ValueError, match=r"SamplingParams\.seed must be an int"):
        params.clone(seed="8")
