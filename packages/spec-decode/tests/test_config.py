import pytest

from ember_spec_decode import SpeculativeConfig


def test_ngram_defaults_follow_vllm():
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    )
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert config.num_lookahead_tokens == 0
    both = SpeculativeConfig("ngram", 2)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)


def test_draft_model_reserves_lookahead():
    config = SpeculativeConfig.from_dict(
        {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}
    )
    assert config.num_lookahead_tokens == 3


@pytest.mark.parametrize(
    "values, field",
    [
        ({"method": "eagle", "num_speculative_tokens": 4}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 3,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "unknown keys"),
    ],
)
def test_errors_name_the_field(values, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(values)
