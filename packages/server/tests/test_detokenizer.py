import pytest

from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.detokenizer import IncrementalDetokenizer

TEXT = "Grüße aus Köln 🙂🔥 日本語のテキスト def foo(): return 1 ∑ π"


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def _stream(tokenizer, ids, params, prompt=(1,), step=1):
    """Feed ids a few at a time; return (deltas, stop string, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params)
    deltas = []
    for i in range(0, len(ids), step):
        stop = detok.update(ids[i : i + step], stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, stop, detok
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, None, detok


@pytest.mark.parametrize("step", [1, 2, 5])
def test_multibyte_characters_stream_whole(tokenizer, step):
    ids = _ids(tokenizer, TEXT)
    # The tokenizer really splits some characters across tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    deltas, stop, detok = _stream(tokenizer, ids, SamplingParams(), step=step)
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids) == TEXT
    assert detok.token_ids == ids


def test_stop_string_excluded_and_split_across_tokens(tokenizer):
    ids = _ids(tokenizer, TEXT)
    params = SamplingParams(stop=["日本語の"])
    deltas, stop, detok = _stream(tokenizer, ids, params)
    assert stop == "日本語の"
    assert detok.output_text == "Grüße aus Köln 🙂🔥 "
    assert "".join(deltas) == detok.output_text
    # Nothing that could be the start of the stop string ever streamed early.
    assert "日" not in "".join(deltas)


def test_stop_string_included(tokenizer):
    ids = _ids(tokenizer, TEXT)
    params = SamplingParams(stop=["foo", "Köln"], include_stop_str_in_output=True)
    deltas, stop, detok = _stream(tokenizer, ids, params)
    assert stop == "Köln"
    assert detok.output_text == "Grüße aus Köln"
    assert "".join(deltas) == "Grüße aus Köln"


def test_earliest_stop_string_wins_within_one_update(tokenizer):
    ids = _ids(tokenizer, TEXT)
    params = SamplingParams(stop=["return", "def"])
    _, stop, detok = _stream(tokenizer, ids, params, step=len(ids))
    assert stop == "def"
    assert detok.output_text == TEXT[: TEXT.index("def")]


def test_min_tokens_defers_stop_strings(tokenizer):
    ids = _ids(tokenizer, "ab ab ab ab")
    params = SamplingParams(stop=["ab"], min_tokens=len(ids))
    _, stop, detok = _stream(tokenizer, ids, params)
    assert stop is None
    assert detok.output_text == "ab ab ab ab"


def test_cumulative_text_withholds_stop_buffer_until_finished(tokenizer):
    params = SamplingParams(stop=["xyz!"])
    detok = IncrementalDetokenizer(tokenizer, [1], params)
    detok.update(_ids(tokenizer, "hello world"), stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=False) == "hello wo"
    assert detok.get_next_output_text(finished=True, delta=False) == "hello world"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = [
        *_ids(tokenizer, "a"),
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        *_ids(tokenizer, "b"),
    ]
    _, _, detok = _stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    assert detok.output_text == ("ab" if skip else "a<|im_end|>b")


@pytest.mark.parametrize("include", [True, False])
def test_stop_token_text_follows_include_stop_str(tokenizer, include):
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [1], params)
    detok.update([*_ids(tokenizer, "done"), tokenizer.eos_token_id], stop_terminated=True)
    assert detok.output_text == ("done<|eos|>" if include else "done")
    assert detok.token_ids[-1] == tokenizer.eos_token_id


def test_incomplete_character_at_the_end_renders_as_decode_does(tokenizer):
    ids = _ids(tokenizer, "ok 🙂")
    cut = ids[:-1]
    assert tokenizer.decode(cut).endswith("\ufffd")
    deltas, _, detok = _stream(tokenizer, cut, SamplingParams())
    assert "".join(deltas) == detok.output_text == tokenizer.decode(cut)
