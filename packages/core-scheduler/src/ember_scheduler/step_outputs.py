"""What one step's ``ModelRunnerOutput`` does to its requests, and what each reports back.

Sampled tokens are appended up to the first stop (EOS unless ``ignore_eos``, a stop token id,
both only once ``min_tokens`` outputs exist; then ``max_tokens`` and the longest sequence);
tokens after a stop are dropped. Drafts are rolled back and proposed through
``DraftScheduling``. Each request's sampled-token logprob rows are sliced out of the step's, and
prompt-logprob rows already sent before a preemption are not sent again. A pooling request
finishes with its prompt, carrying the pooled vector.
"""

from __future__ import annotations

import itertools

from ember_scheduler.draft_scheduling import DraftScheduling
from ember_scheduler.engine_types import EngineCoreOutput, FinishReason
from ember_scheduler.outputs import Logprobs, ModelRunnerOutput, SchedulerOutput
from ember_scheduler.request import Request, RequestStatus

# An enum member read through its class costs a lookup per request and step; a module name does not.
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class StepOutputApplier:
    """Applies model outputs to the requests of one scheduler (``max_num_tokens``: its longest
    sequence)."""

    def __init__(self, drafts: DraftScheduling, max_num_tokens: int) -> None:
        self.drafts = drafts
        self.max_num_tokens = max_num_tokens

    def apply(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        requests: dict[str, Request],
        outputs: list[EngineCoreOutput],
    ) -> tuple[list[Request], list[Request]]:
        """Apply one step's output to ``requests``, appending what changed to ``outputs``.

        Returns the requests it finished: those running, and those preempted while the step was
        in flight (async scheduling), which keep the step's token.
        """
        sampled_token_ids = model_runner_output.sampled_token_ids
        spec_token_ids = model_runner_output.spec_token_ids
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        prompt_logprobs = model_runner_output.prompt_logprobs
        logprobs = model_runner_output.logprobs
        logprob_offsets = None
        if logprobs is not None:
            logprob_offsets = list(
                itertools.accumulate((len(t) for t in sampled_token_ids), initial=0)
            )
        pooler_output = model_runner_output.pooler_output
        finished: list[Request] = []
        finished_preempted: list[Request] = []

        for index, req_id in enumerate(model_runner_output.req_ids):
            request = requests.get(req_id)
            if request is None:
                continue  # finished or aborted since it was scheduled
            status = request.status
            if status != _RUNNING and status != _PREEMPTED:
                continue
            # PREEMPTED: preempted while this step was in flight (async scheduling); it keeps
            # the step's token.
            if request.pooling_params is not None:
                pooled = pooler_output.get(req_id)
                if pooled is not None:  # else a prefill chunk: nothing to report yet
                    outputs.append(_finish_pooled(request, pooled))
                    (finished if status == _RUNNING else finished_preempted).append(request)
                continue
            new_token_ids = sampled_token_ids[index]
            finish_reason = None
            if new_token_ids:
                if request.num_output_placeholders:
                    request.num_output_placeholders -= len(new_token_ids)
                self.drafts.take_output(
                    request,
                    scheduled_spec.get(req_id),
                    new_token_ids,
                    None if spec_token_ids is None else spec_token_ids[index],
                )
                new_token_ids, finish_reason = self._append_until_stop(request, new_token_ids)

            new_logprobs = None
            if logprob_offsets is not None and request.sampling_params.logprobs is not None:
                new_logprobs = _slice_rows(logprobs, logprob_offsets[index], len(new_token_ids))
            new_prompt_logprobs = None
            if prompt_logprobs:
                chunk = prompt_logprobs.get(req_id)
                if chunk is not None:
                    new_prompt_logprobs = _unseen_prompt_logprobs(request, chunk)

            if finish_reason is not None:
                request.set_status(
                    RequestStatus.FINISHED_STOPPED
                    if finish_reason == FinishReason.STOP
                    else RequestStatus.FINISHED_LENGTH_CAPPED
                )
                (finished if status == _RUNNING else finished_preempted).append(request)
            elif not new_token_ids and new_prompt_logprobs is None:
                continue  # a prefill chunk: nothing to report yet
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    new_logprobs,
                    new_prompt_logprobs,
                    finish_reason,
                    request.stop_reason,
                    request.num_cached_tokens,
                )
            )
        return finished, finished_preempted

    def _append_until_stop(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], FinishReason | None]:
        """Append sampled tokens up to the first that ends the request.

        Returns the tokens kept (those after a stop are dropped) and the finish reason, if any.
        """
        output_ids = request.output_token_ids
        all_ids = request.all_token_ids
        eos_token_id = request.eos_token_id
        for count, token in enumerate(new_token_ids, 1):
            output_ids.append(token)
            all_ids.append(token)
            num_outputs = len(output_ids)
            # The worker's sampler cannot pick EOS or a stop id before min_tokens outputs; the
            # min_tokens test holds the rule for an executor that does not mask (as vLLM's
            # check_stop does).
            if (
                token == eos_token_id or token in request.stop_token_ids
            ) and num_outputs >= request.min_tokens:
                if token != eos_token_id:
                    request.stop_reason = token
                return new_token_ids[:count], FinishReason.STOP
            if num_outputs >= request.max_tokens or len(all_ids) >= self.max_num_tokens:
                return new_token_ids[:count], FinishReason.LENGTH
        return new_token_ids, None


def _unseen_prompt_logprobs(request: Request, chunk: Logprobs) -> Logprobs | None:
    """Drop prompt-logprob rows already sent before a preemption made the worker redo them."""
    seen = request.num_prompt_logprob_rows_seen
    rows = len(chunk.ranks)
    request.num_prompt_logprob_rows_seen = seen + rows
    skip = request.num_prompt_logprob_rows_sent - seen
    if skip <= 0:
        request.num_prompt_logprob_rows_sent += rows
        return chunk
    if skip >= rows:
        return None
    request.num_prompt_logprob_rows_sent += rows - skip
    return Logprobs(chunk.token_ids[skip:], chunk.logprobs[skip:], chunk.ranks[skip:])


def _finish_pooled(request: Request, pooled: bytes) -> EngineCoreOutput:
    """A pooling request ends with its prompt: STOP, carrying the pooled vector."""
    request.set_status(RequestStatus.FINISHED_STOPPED)
    return EngineCoreOutput(
        request.request_id,
        [],
        finish_reason=FinishReason.STOP,
        num_cached_tokens=request.num_cached_tokens,
        pooling_output=pooled,
    )


def _slice_rows(logprobs: Logprobs, start: int, count: int) -> Logprobs:
    """One request's ``count`` sampled-token rows of the step's logprobs, from ``start``."""
    end = start + count
    return Logprobs(
        logprobs.token_ids[start:end], logprobs.logprobs[start:end], logprobs.ranks[start:end]
    )
