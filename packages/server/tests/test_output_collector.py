"""RequestOutputCollector: a late consumer gets the producer's outputs folded into one."""

import asyncio

import pytest

from ember_server.engine.output_collector import RequestOutputCollector
from ember_server.engine.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind


def _output(deltas, finished=False, prompt_logprobs=None, cached=0):
    """A RequestOutput of (index, text, token_ids, finish_reason) sequences with logprobs."""
    completions = [
        CompletionOutput(
            index=index,
            text=text,
            token_ids=list(ids),
            cumulative_logprob=-float(sum(ids)),
            logprobs=[{t: Logprob(-float(t))} for t in ids],
            finish_reason=reason,
        )
        for index, text, ids, reason in deltas
    ]
    return RequestOutput("r", "p", [1, 2], prompt_logprobs, completions, finished, cached)


def test_a_late_consumer_gets_the_deltas_merged_per_sequence():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    collector.put(_output([(0, "a", [1], None)], prompt_logprobs=[None]))
    collector.put(_output([(1, "x", [7], None), (0, "b", [2], None)], cached=4))
    collector.put(_output([(0, "c", [3], "length")], cached=4))
    merged = collector.get_nowait()
    assert collector.get_nowait() is None
    by_index = {c.index: c for c in merged.outputs}
    assert (by_index[0].text, by_index[0].token_ids) == ("abc", [1, 2, 3])
    assert [list(lp) for lp in by_index[0].logprobs] == [[1], [2], [3]]
    assert by_index[0].cumulative_logprob == -3.0 and by_index[0].finish_reason == "length"
    assert (by_index[1].text, by_index[1].token_ids) == ("x", [7])
    assert merged.prompt_logprobs == [None] and merged.num_cached_tokens == 4
    assert not merged.finished


def test_the_merged_output_is_finished_when_the_last_one_is():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    collector.put(_output([(0, "a", [1], None)]))
    collector.put(_output([(0, "b", [2], "stop")], finished=True))
    merged = collector.get_nowait()
    assert merged.finished and merged.outputs[0].text == "ab"
    assert merged.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
def test_other_kinds_keep_only_the_latest(kind):
    collector = RequestOutputCollector(kind)
    collector.put(_output([(0, "a", [1], None)]))
    latest = _output([(0, "ab", [1, 2], None)])
    collector.put(latest)
    assert collector.get_nowait() is latest


def test_an_error_wins_over_outputs_before_and_after_it():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    collector.put(_output([(0, "a", [1], None)]))
    collector.put(ValueError("refused"))
    collector.put(_output([(0, "b", [2], None)]))
    with pytest.raises(ValueError, match="refused"):
        collector.get_nowait()
    assert collector.get_nowait() is None


def test_get_waits_for_the_next_output():
    async def run():
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        waiter = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0)
        assert not waiter.done()
        collector.put(_output([(0, "a", [1], None)]))
        first = await waiter
        collector.put(_output([(0, "b", [2], None)]))
        return first, await collector.get()

    first, second = asyncio.run(run())
    assert first.outputs[0].text == "a" and second.outputs[0].text == "b"
