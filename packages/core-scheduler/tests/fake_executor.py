"""A deterministic fake executor and the reference it must agree with.

The fake model's next token is a function of the whole sequence so far (``next_token``). The
executor behaves as a worker does: it keeps each request's tokens (persistent batch), applies the
``SchedulerOutput`` diffs, writes every scheduled token into a fake paged KV cache at the slots
its block table gives, and predicts from what it reads back out of that cache. A wrong block
table, a block shared when it should not be, a prefix-cache hit with the wrong content or a
wrong ``num_computed_tokens`` therefore changes the outputs (and trips an assertion).
"""

from __future__ import annotations

import random
from concurrent.futures import Future

import numpy as np

from ember_kv_cache import KVConnectorOutput, TieredKVStore
from ember_scheduler import (
    DRAFT_PLACEHOLDER,
    EngineCore,
    Logprobs,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)

VOCAB_SIZE = 97
EOS_TOKEN_ID = 0
_MAX_POSITIONS = 1 << 14
_WEIGHTS = (np.arange(_MAX_POSITIONS, dtype=np.int64) * 7919 + 13) % 10007


def _mix(h: np.ndarray | int):
    return (h ^ (h >> 5)) % VOCAB_SIZE


def next_token(sequence: list[int]) -> int:
    """The fake model: the token that follows ``sequence``."""
    n = len(sequence)
    h = int(np.dot(np.asarray(sequence, dtype=np.int64) + 1, _WEIGHTS[:n])) + n
    return int(_mix(h))


def draft_tokens(sequence: list[int], k: int) -> list[int]:
    """A fake drafter: mostly right, deterministically wrong now and then."""
    seq = list(sequence)
    drafts = []
    for _ in range(k):
        token = next_token(seq)
        if (len(seq) * 31 + token) % 4 == 0:
            token = (token + 1) % VOCAB_SIZE
        drafts.append(token)
        seq.append(token)
    return drafts


def reference_output(
    prompt: list[int],
    params: SamplingParams,
    max_len: int,
    eos_token_id: int | None = EOS_TOKEN_ID,
) -> tuple[list[int], str, int | None]:
    """What a request must produce: (output tokens, finish reason word, stop reason)."""
    if len(prompt) > max_len:
        return [], "ignored", None
    seq = list(prompt)
    out: list[int] = []
    max_tokens = params.max_tokens if params.max_tokens is not None else 1 << 62
    stop_ids = set(params.stop_token_ids)
    while True:
        token = next_token(seq)
        seq.append(token)
        out.append(token)
        if len(out) >= params.min_tokens:
            if not params.ignore_eos and token == eos_token_id:
                return out, "stop", None
            if token in stop_ids:
                return out, "stop", token
        if len(out) >= max_tokens or len(seq) >= max_len:
            return out, "length", None


class _WorkerRequest:
    __slots__ = (
        "block_ids",
        "drafts",
        "num_accepted",
        "num_computed_tokens",
        "params",
        "prompt_len",
        "tokens",
    )

    def __init__(self, tokens, block_ids, num_computed_tokens, params, prompt_len):
        self.tokens = tokens
        self.drafts: list[int] = []  # proposed last step: what draft placeholders stand for
        self.num_accepted = 0  # drafts the last step accepted
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens
        self.params = params
        self.prompt_len = prompt_len


class FakeExecutor:
    """Deterministic stand-in for the worker's executor (see the module docstring)."""

    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        *,
        num_spec_tokens: int = 0,
        kv_transfer_store: TieredKVStore | None = None,
        load_delay_steps: int = 0,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = VOCAB_SIZE
        self.num_spec_tokens = num_spec_tokens
        self.kv = np.full((num_kv_blocks, block_size), -1, dtype=np.int64)
        self.requests: dict[str, _WorkerRequest] = {}
        self.scheduler_outputs: list[SchedulerOutput] = []
        self.is_shut_down = False
        # The worker side of a KV connector, over the fake cache: a chunk is its token ids.
        self.kv_transfer_store = kv_transfer_store
        self.load_delay_steps = load_delay_steps
        self._loads: list[tuple[int, object]] = []  # (step it finishes, ChunkTransfer)

    def execute_model(
        self, so: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run the step now; with ``non_block`` its output comes back as a done future, which
        the engine core applies only later (async scheduling), as with a real worker."""
        output = self._execute(so)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.scheduler_outputs.append(so)
        step = len(self.scheduler_outputs)
        if so.kv_block_copies:  # partial prefix hits: whole blocks, before anything is written
            source, target = np.array(so.kv_block_copies).T
            self.kv[target] = self.kv[source]
        if so.kv_connector_metadata is not None:
            self._loads += [
                (step + self.load_delay_steps, t) for t in so.kv_connector_metadata.loads
            ]
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            assert req_id in self.requests, f"worker told to drop unknown request {req_id}"
            del self.requests[req_id]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent in full twice"
            assert 0 not in new.block_ids, "the null block was handed out"
            self.requests[new.req_id] = _WorkerRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
                len(new.prompt_token_ids),
            )
        cached = so.scheduled_cached_reqs
        in_flight = cached.num_drafts_in_flight or [0] * len(cached.req_ids)
        for req_id, new_block_ids, num_computed, num_drafts in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, in_flight
        ):
            state = self.requests[req_id]
            state.block_ids.extend(new_block_ids)
            # async scheduling counted the drafts of the step before as accepted
            rejected = num_drafts - state.num_accepted if num_drafts else 0
            state.num_computed_tokens = num_computed - rejected

        req_ids = list(so.num_scheduled_tokens)
        work = {r: self._resolve_drafts(so, r) for r in req_ids}
        sampled: list[list[int]] = []
        spec: list[list[int]] = []
        prompt_logprobs: dict[str, Logprobs] = {}
        # As in a real forward pass, every scheduled token's KV is written before any request
        # attends, so a request may read blocks another one fills in the same step.
        for req_id in req_ids:
            self._write_kv(req_id, self.requests[req_id], *work[req_id])
        for req_id in req_ids:
            state = self.requests[req_id]
            num_tokens, drafts = work[req_id]
            new_tokens, plp = self._forward(req_id, state, num_tokens, drafts)
            sampled.append(new_tokens)
            state.num_accepted = len(new_tokens) - 1 if drafts else 0
            state.drafts = (
                draft_tokens(state.tokens, self.num_spec_tokens)
                if new_tokens and self.num_spec_tokens
                else []
            )
            spec.append(state.drafts)
            if plp is not None:
                prompt_logprobs[req_id] = plp
        rows = [t for tokens in sampled for t in tokens]
        kv_connector_output = None
        if so.kv_connector_metadata is not None:
            kv_connector_output = self._transfer_kv(so.kv_connector_metadata, step)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=Logprobs(
                [[t, (t + 1) % VOCAB_SIZE] for t in rows],
                [[-0.5, -1.5] for _ in rows],
                [1 for _ in rows],
            ),
            prompt_logprobs=prompt_logprobs,
            spec_token_ids=spec if self.num_spec_tokens else None,
            kv_connector_output=kv_connector_output,
        )

    def _chunk_slots(
        self, transfer, index: int, num_tokens: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slots of chunk ``index`` (its first ``num_tokens`` tokens, all by default)."""
        chunk_size = self.kv_transfer_store.fingerprint.chunk_size
        start = index * chunk_size
        positions = np.arange(start, start + (num_tokens or chunk_size))
        table = np.asarray(transfer.block_ids, dtype=np.int64)
        return table[positions // self.block_size], positions % self.block_size

    def _transfer_kv(self, meta, step: int) -> KVConnectorOutput:
        """Save the step's chunks (a finished request's partial one reported as saved); finish
        the loads that are due."""
        store = self.kv_transfer_store
        output = KVConnectorOutput()
        for transfer in meta.saves:
            partial_tokens = transfer.partial_blocks * self.block_size or None
            for offset, chunk_hash in enumerate(transfer.chunk_hashes):
                slots = self._chunk_slots(transfer, transfer.first_chunk + offset, partial_tokens)
                store.put(chunk_hash, self.kv[slots])
            if transfer.partial_blocks:
                output.finished_saving.append(transfer.request_id)
        due = [t for ready, t in self._loads if ready <= step]
        self._loads = [(ready, t) for ready, t in self._loads if ready > step]
        chunk_size = store.fingerprint.chunk_size
        for transfer in due:
            in_place = transfer.first_chunk * chunk_size + transfer.skip_tokens
            last = len(transfer.chunk_hashes) - 1
            for offset, chunk_hash in enumerate(transfer.chunk_hashes):
                chunk = store.get(chunk_hash)
                if chunk is None:
                    break
                index = transfer.first_chunk + offset
                num_tokens = chunk_size
                if offset == last and transfer.partial_blocks:
                    num_tokens = transfer.partial_blocks * self.block_size
                self.kv[self._chunk_slots(transfer, index, num_tokens)] = chunk[:num_tokens]
                in_place = index * chunk_size + num_tokens
            output.finished_loading[transfer.request_id] = in_place
        return output

    def _resolve_drafts(self, so: SchedulerOutput, req_id: str) -> tuple[int, list[int]]:
        """The tokens to run and the drafts among them: draft placeholders stand for the drafts
        proposed last step (fewer of those: fewer tokens run)."""
        num_tokens = so.num_scheduled_tokens[req_id]
        drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
        if drafts and drafts[0] == DRAFT_PLACEHOLDER:
            held = self.requests[req_id].drafts[: len(drafts)]
            return num_tokens - (len(drafts) - len(held)), held
        # Drafts the scheduler learned from an output: what this worker proposed (or a prefix).
        assert drafts == self.requests[req_id].drafts[: len(drafts)], f"{req_id}: stale drafts"
        return num_tokens, drafts

    def _write_kv(
        self, req_id: str, state: _WorkerRequest, num_tokens: int, drafts: list[int]
    ) -> None:
        start = state.num_computed_tokens
        end = start + num_tokens
        known = state.tokens + drafts
        assert end <= len(known), f"{req_id}: scheduled past its known tokens"
        size = self.block_size
        assert -(-end // size) <= len(state.block_ids), f"{req_id}: no KV slot for token {end - 1}"
        table = np.asarray(state.block_ids, dtype=np.int64)
        positions = np.arange(start, end)
        self.kv[table[positions // size], positions % size] = known[start:end]

    def _forward(
        self, req_id: str, state: _WorkerRequest, num_tokens: int, drafts: list[int]
    ) -> tuple[list[int], Logprobs | None]:
        start = state.num_computed_tokens
        end = start + num_tokens
        known = state.tokens + drafts
        size = self.block_size
        table = np.asarray(state.block_ids, dtype=np.int64)

        plp = None
        if state.params.prompt_logprobs is not None and start < state.prompt_len - 1:
            targets = state.tokens[start + 1 : min(end, state.prompt_len - 1) + 1]
            plp = Logprobs([[t] for t in targets], [[-1.0] for _ in targets], [1] * len(targets))
        if end < len(state.tokens):
            return [], plp  # a prefill chunk: nothing to sample yet

        positions = np.arange(end)
        context = self.kv[table[positions // size], positions % size]
        assert context.tolist() == known[:end], f"{req_id}: KV cache holds the wrong tokens"
        # Predictions after each of the last len(drafts) + 1 positions, in one pass.
        prefix_sums = np.cumsum((context + 1) * _WEIGHTS[:end])
        first = len(state.tokens) - 1
        predictions = _mix(prefix_sums[first:end] + np.arange(first + 1, end + 1)).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == predictions[accepted]:
            accepted += 1
        new_tokens = predictions[: accepted + 1]
        state.tokens.extend(new_tokens)
        return new_tokens, plp

    def shutdown(self) -> None:
        self.is_shut_down = True


def make_request(
    request_id: str, prompt: list[int], params: SamplingParams | None = None, **kwargs
) -> Request:
    return Request(
        request_id,
        prompt,
        params if params is not None else SamplingParams(max_tokens=8),
        eos_token_id=kwargs.pop("eos_token_id", EOS_TOKEN_ID),
        **kwargs,
    )


class Collected:
    """Everything an engine emitted for one request."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprob_token_ids: list[int] = []
        self.prompt_logprob_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finish_detail: str | None = None
        self.num_cached_tokens = 0


def collect(outputs, results: dict[str, Collected]) -> None:
    """Fold one step's ``EngineCoreOutputs`` into ``results``; fails on output after finish."""
    for out in outputs.outputs:
        got = results.setdefault(out.request_id, Collected())
        assert got.finish_reason is None, f"{out.request_id} produced output after finishing"
        got.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            got.logprob_token_ids.extend(row[0] for row in out.new_logprobs.token_ids)
        if out.new_prompt_logprobs is not None:
            got.prompt_logprob_token_ids.extend(row[0] for row in out.new_prompt_logprobs.token_ids)
        got.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            got.finish_reason = str(out.finish_reason)
            got.stop_reason = out.stop_reason
            got.finish_detail = out.finish_detail


def run_to_completion(engine, max_steps: int = 100_000) -> tuple[dict[str, Collected], list]:
    """Step until no request is left; returns the collected outputs and every step's stats."""
    results: dict[str, Collected] = {}
    stats = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return results, stats
        outputs = engine.step()
        stats.append(outputs.scheduler_stats)
        collect(outputs, results)
    raise AssertionError(f"not done after {max_steps} steps")


def engine_with_fake_executor(num_blocks=64, block_size=4, num_spec_tokens=0, **config):
    """An ``EngineCore`` over a fresh ``FakeExecutor`` (``max_model_len`` 256 unless given), and
    the executor."""
    config.setdefault("max_model_len", 256)
    executor = FakeExecutor(num_blocks, block_size, num_spec_tokens=num_spec_tokens)
    return EngineCore(executor, SchedulerConfig(**config)), executor


def random_prompts(count, seed=0, max_len=40):
    """``count`` prompts of 1 to ``max_len`` - 1 tokens, by request id."""
    rng = random.Random(seed)
    return {
        f"r{i}": [rng.randrange(1, 97) for _ in range(rng.randrange(1, max_len))]
        for i in range(count)
    }


def assert_all_free(engine):
    """Every KV block back in the pool and no request left in the scheduler."""
    kv = engine.kv_cache_manager
    assert kv.usage == 0.0
    assert kv.num_free_blocks == engine.scheduler.num_kv_blocks
    assert not engine.scheduler.requests and not engine.scheduler.running
