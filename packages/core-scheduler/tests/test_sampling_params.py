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
        ("n", 0, "at least 1"),
        ("seed", 2**63, "signed 64-bit"),
        ("seed", -(2**63) - 1, "signed 64-bit"),
        ("max_tokens", 0, "at least 1"),
        ("min_tokens", -1, "at least 0"),
        ("temperature", -0.1, "[0, 100]"),
        ("temperature", 101.0, "[0, 100]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, "-1, 0"),
        ("min_p", 1.5, "[0, 1]"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3.0, "[-2, 2]"),
        ("repetition_penalty", 0.0, "(0, 10]"),
        ("logprobs", 21, "[0, 20]"),
        ("prompt_logprobs", -1, "[0, 20]"),
        ("stop", [""], "non-empty strings"),
        ("stop_token_ids", [-1], "non-negative"),
    ],
)
def test_out_of_range_values_name_the_field_and_the_range(field, value, words):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} ") as info:
        SamplingParams(**{field: value})
    assert words in str(info.value)


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
