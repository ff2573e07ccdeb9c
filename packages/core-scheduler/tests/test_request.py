import pytest

from ember_scheduler import (
    EngineCoreRequest,
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    SchedulerConfig,
)
from ember_scheduler.request_queue import FCFSRequestQueue, PriorityRequestQueue


def test_request_from_engine_core_request():
    wire = EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=None), 0, 5.0, 2, "salt")
    request = Request.from_engine_core_request(wire)
    assert request.all_token_ids == [1, 2, 3] and request.num_tokens == 3
    assert request.arrival_time == 5.0 and request.priority == 2
    assert request.block_hash_extras is not None and request.block_hash_extras.cache_salt == "salt"
    assert request.max_tokens > 1 << 40  # None: bounded by the context only
    assert request.status == RequestStatus.WAITING and request.get_finished_reason() is None


def test_ignore_eos_drops_the_eos_token():
    request = Request("a", [1], SamplingParams(ignore_eos=True), eos_token_id=0)
    assert request.eos_token_id is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"request_id": ""}, "request_id"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"sampling_params": SamplingParams(n=2)}, "n must be 1"),
    ],
)
def test_bad_requests_are_rejected(kwargs, match):
    args = {"request_id": "a", "prompt_token_ids": [1], "sampling_params": SamplingParams()}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Request(**args)


def test_status_state_machine():
    request = Request("a", [1], SamplingParams())
    request.set_status(RequestStatus.RUNNING)
    request.set_status(RequestStatus.PREEMPTED)
    request.set_status(RequestStatus.RUNNING)
    request.set_status(RequestStatus.FINISHED_LENGTH_CAPPED)
    assert request.is_finished() and request.get_finished_reason() == FinishReason.LENGTH
    assert str(request.get_finished_reason()) == "length"
    with pytest.raises(RuntimeError, match="FINISHED_LENGTH_CAPPED to RUNNING"):
        request.set_status(RequestStatus.RUNNING)
    waiting = Request("b", [1], SamplingParams())
    with pytest.raises(RuntimeError):
        waiting.set_status(RequestStatus.FINISHED_STOPPED)  # only a running request stops
    waiting.set_status(RequestStatus.FINISHED_IGNORED)
    assert str(waiting.get_finished_reason()) == "ignored"


def test_append_output_tokens_grows_the_shared_token_list():
    request = Request("a", [1, 2], SamplingParams())
    tokens = request.all_token_ids
    request.append_output_token_ids([5, 6])
    assert tokens is request.all_token_ids and tokens == [1, 2, 5, 6]
    assert request.output_token_ids == [5, 6] and request.num_output_tokens == 2


def _req(request_id, priority=0, arrival=0.0):
    return Request(request_id, [1], SamplingParams(), priority=priority, arrival_time=arrival)


def test_fcfs_queue_order_and_prepend():
    queue = FCFSRequestQueue()
    a, b, c = _req("a"), _req("b"), _req("c")
    queue.add_request(a)
    queue.add_request(b)
    queue.prepend_request(c)
    assert [r.request_id for r in queue] == ["c", "a", "b"]
    queue.remove_request(a)
    assert queue.pop_request() is c and queue.peek_request() is b and len(queue) == 1


def test_priority_queue_orders_by_priority_then_arrival_and_removes_lazily():
    queue = PriorityRequestQueue()
    for request in (_req("late", 1, 3.0), _req("early", 1, 1.0), _req("urgent", 0, 9.0)):
        queue.add_request(request)
    assert [r.request_id for r in queue] == ["urgent", "early", "late"]
    queue.remove_request(queue.peek_request())
    assert len(queue) == 2 and queue.pop_request().request_id == "early"
    with pytest.raises(ValueError, match="not in the queue"):
        queue.remove_request(_req("ghost"))
    assert queue.pop_request().request_id == "late" and not queue
    with pytest.raises(IndexError):
        queue.peek_request()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"policy": "lifo"}, "policy"),
        ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16}, "max_num_batched"),
    ],
)
def test_scheduler_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"SchedulerConfig\.{field}"):
        SchedulerConfig(**kwargs)
