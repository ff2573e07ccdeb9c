"""The persistent input batch: every running request's state in preallocated numpy rows.

Each request occupies one row. Token ids and block-table rows are 2-D buffers sized once for
``max_num_reqs × max_model_len`` (and ``× max_blocks_per_req``); everything else about a row (its
lengths and sampling parameters) lives in one structured array, so moving a row moves all of its
side state in one numpy assignment. A row's buffers are valid only up to its own lengths
(``num_tokens`` for tokens, ``num_blocks`` for block ids); moving a row copies exactly that
prefix, and nothing reads past it.

Per step the model runner updates the rows from the scheduler's diff, condenses them, sets the
scheduled counts, and reads them: ``model_inputs.ModelInputBuffers`` flattens the step's inputs
and ``sampling_metadata.build_sampling_metadata`` gathers the sampling parameters, neither
changing the batch. ``append_token_runs`` then records the step's result. Draft tokens live in
the token rows too (``draft_slots.DraftSlots``); min_tokens stop ids beside the rows
(``min_tokens.MinTokensStops``).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from ember_scheduler.outputs import NewRequestData
from ember_worker.draft_slots import DraftSlots
from ember_worker.min_tokens import MinTokensStops

# Everything a row holds besides its token ids and block ids. One record per row, so that moving
# a row's side state is a single numpy assignment whatever the number of fields.
ROW_STATE_DTYPE = np.dtype(
    [
        ("num_tokens", np.int32),  # tokens held, speculative draft tokens included
        ("num_tokens_no_spec", np.int32),  # prompt + output tokens
        ("num_prompt_tokens", np.int32),
        ("num_computed_tokens", np.int32),  # tokens whose KV is in the cache
        ("num_blocks", np.int32),  # valid entries of the block-table row
        ("num_scheduled_tokens", np.int32),  # this step's, from set_num_scheduled_tokens
        ("temperature", np.float32),
        ("top_p", np.float32),
        ("top_k", np.int32),  # 0: disabled
        ("min_p", np.float32),
        ("presence_penalty", np.float32),
        ("frequency_penalty", np.float32),
        ("repetition_penalty", np.float32),
        ("num_logprobs", np.int32),  # -1: none asked
        ("num_prompt_logprobs", np.int32),  # -1: none asked
        ("min_tokens", np.int32),  # outputs before EOS/stop ids may be sampled; 0: no mask
        ("has_seed", np.bool_),
        ("seed", np.int64),
        ("num_accepted_drafts", np.int32),  # of the row's last step (draft_slots)
        ("lora_id", np.int32),  # the LoRA adapter's lora_int_id; 0: the base model
    ],
    align=True,
)


def _cdiv(a, b):
    return -(-a // b)


class InputBatch:
    """Persistent, preallocated state of the requests the worker is running (one row each).

    Rows are added at the lowest free row; ``remove_request`` leaves a hole that ``condense``
    fills by moving rows down from the end. A step's counts are set, and its inputs and sampling
    metadata read, only on a condensed batch (rows ``0..num_reqs-1``). Its sizes come from the
    executor, which checked them.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
        num_kv_groups: int = 1,
        num_state_blocks: int = 0,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        # Several KV groups' tables share a row, interleaved (ember_worker.kv_specs).
        self.num_kv_groups = num_kv_groups
        # A Mamba hybrid's state blocks (one per state group) lead its row.
        self.num_state_blocks = num_state_blocks
        self.max_blocks_per_req = (
            _cdiv(max_model_len, block_size) * num_kv_groups + num_state_blocks
        )
        self.device = torch.device(device)

        # Row storage. zeros() is lazily backed by the OS, so unused tails cost no memory. The
        # block table is a (pinned, off the CPU) tensor, as the model inputs pass it on as is.
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.block_table_cpu_tensor = torch.zeros(
            (max_num_reqs, self.max_blocks_per_req),
            dtype=torch.int32,
            pin_memory=self.device.type == "cuda",
        )
        self.block_table_cpu = self.block_table_cpu_tensor.numpy()
        self.rows = np.zeros(max_num_reqs, dtype=ROW_STATE_DTYPE)
        # The same memory as raw bytes: copying a byte row is the fastest whole-record move.
        self._row_bytes = self.rows.view(np.uint8).reshape(max_num_reqs, ROW_STATE_DTYPE.itemsize)
        self.num_tokens = self.rows["num_tokens"]
        self.num_tokens_no_spec = self.rows["num_tokens_no_spec"]
        self.num_prompt_tokens = self.rows["num_prompt_tokens"]
        self.num_computed_tokens = self.rows["num_computed_tokens"]
        self.num_blocks = self.rows["num_blocks"]
        self.num_scheduled_tokens = self.rows["num_scheduled_tokens"]

        self._req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self._num_rows = 0  # rows in use, holes included
        self._holes: list[int] = []  # min-heap of free rows below _num_rows
        # Bumped whenever a row is added, removed or moved: what is gathered from the rows'
        # parameters (sampling_metadata.SamplingMetadataBuilder) holds while it is unchanged.
        self.rows_version = 0
        self.drafts = DraftSlots(self)
        self.min_tokens_stops = MinTokensStops(vocab_size)

    # ------------------------------------------------------------------ membership

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str | None]:
        """Request id of each row in row order (``None`` for a hole until ``condense``)."""
        return self._req_ids[: self._num_rows]

    def add_request(self, new_req: NewRequestData) -> int:
        """Store a request (prompt and output tokens, blocks, sampling params); returns its row.

        Token ids and EOS were checked when the engine core admitted the request; what is checked
        here is that the scheduler's numbers fit this batch.
        """
        req_id = new_req.req_id
        if req_id in self.req_id_to_index:
            raise ValueError(f"NewRequestData.req_id {req_id!r} is already in the batch")
        if self.num_reqs >= self.max_num_reqs:
            raise ValueError(
                f"InputBatch is full ({self.max_num_reqs} requests); cannot add {req_id!r}"
            )
        prompt = np.asarray(new_req.prompt_token_ids, dtype=np.int64)
        output = np.asarray(new_req.output_token_ids, dtype=np.int64)
        num_prompt, num_tokens = len(prompt), len(prompt) + len(output)
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"NewRequestData.prompt_token_ids + output_token_ids of {req_id!r} hold "
                f"{num_tokens} tokens, more than max_model_len {self.max_model_len}"
            )
        if len(new_req.block_ids) > self.max_blocks_per_req:
            raise ValueError(
                f"NewRequestData.block_ids of {req_id!r} has {len(new_req.block_ids)} blocks, "
                f"more than {self.max_blocks_per_req} per request"
            )
        params = new_req.sampling_params
        if not 0 <= new_req.num_computed_tokens <= num_tokens:
            raise ValueError(
                f"NewRequestData.num_computed_tokens of {req_id!r} must be in [0, {num_tokens}], "
                f"got {new_req.num_computed_tokens}"
            )

        row = heapq.heappop(self._holes) if self._holes else self._num_rows
        self._num_rows = max(self._num_rows, row + 1)
        self._req_ids[row] = req_id
        self.req_id_to_index[req_id] = row
        self.rows_version += 1

        self.token_ids_cpu[row, :num_prompt] = prompt
        self.token_ids_cpu[row, num_prompt:num_tokens] = output
        num_blocks = len(new_req.block_ids)
        self.block_table_cpu[row, :num_blocks] = new_req.block_ids
        self.rows[row] = (
            num_tokens,
            num_tokens,
            num_prompt,
            new_req.num_computed_tokens,
            num_blocks,
            0,
            params.temperature,
            params.top_p,
            min(
                params.top_k, self.vocab_size
            ),  # a larger top_k keeps every token, as the vocabulary does
            params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
            -1 if params.logprobs is None else params.logprobs,
            -1 if params.prompt_logprobs is None else params.prompt_logprobs,
            self.min_tokens_stops.add_request(new_req),
            params.seed is not None,
            0 if params.seed is None else params.seed,
            0,
            0 if new_req.lora_request is None else new_req.lora_request.lora_int_id,
        )
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Drop a request, leaving a hole at its row; returns that row (None if not held)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.rows_version += 1
        self._req_ids[row] = None
        self.min_tokens_stops.remove_request(req_id)
        self.num_tokens[row] = 0
        self.num_tokens_no_spec[row] = 0
        self.num_blocks[row] = 0
        if row == self._num_rows - 1:
            self._num_rows -= 1
            self._trim_trailing_holes()
        else:
            heapq.heappush(self._holes, row)
        return row

    def _trim_trailing_holes(self) -> None:
        """Shrink the used rows past trailing holes, which then stop being holes."""
        while self._num_rows and self._req_ids[self._num_rows - 1] is None:
            self._num_rows -= 1
        self._holes = [h for h in self._holes if h < self._num_rows]
        heapq.heapify(self._holes)

    def condense(self) -> None:
        """Fill every hole by moving the last row into it, so rows ``0..num_reqs-1`` are dense."""
        while self._holes:
            hole = heapq.heappop(self._holes)
            if hole >= self._num_rows:
                continue
            last = self._num_rows - 1
            self._move_row(last, hole)
            self._num_rows -= 1
            self._trim_trailing_holes()

    def _move_row(self, src: int, dst: int) -> None:
        self.rows_version += 1
        n = self.num_tokens[src]
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        b = self.num_blocks[src]
        self.block_table_cpu[dst, :b] = self.block_table_cpu[src, :b]
        self._row_bytes[dst] = self._row_bytes[src]
        req_id = self._req_ids[src]
        self._req_ids[dst] = req_id
        self._req_ids[src] = None
        self.req_id_to_index[req_id] = dst

    # ------------------------------------------------------------------ per-step updates

    def check_condensed(self, caller: str) -> None:
        """Raise if rows ``0..num_reqs-1`` are not exactly the requests (a hole is left)."""
        if self._holes:
            raise ValueError(f"{caller} needs a condensed batch; call condense() first")

    def row_of(self, req_id: str) -> int:
        row = self.req_id_to_index.get(req_id)
        if row is None:
            raise ValueError(f"req_id {req_id!r} is not in the batch")
        return row

    def append_block_ids(self, req_id: str, block_ids: list[int]) -> None:
        """Append newly allocated blocks to a request's block-table row."""
        row = self.row_of(req_id)
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"block_ids: {req_id!r} would hold {end} blocks, more than "
                f"{self.max_blocks_per_req} per request"
            )
        self.block_table_cpu[row, start:end] = block_ids
        self.num_blocks[row] = end

    def set_num_computed_tokens(
        self, req_id: str, num_computed_tokens: int, num_drafts_in_flight: int = 0
    ) -> None:
        """``set_num_computed_tokens_of`` for one request."""
        self.set_num_computed_tokens_of([req_id], [num_computed_tokens], [num_drafts_in_flight])

    def set_num_computed_tokens_of(
        self,
        req_ids: list[str],
        num_computed_tokens: list[int],
        num_drafts_in_flight: list[int] | None = None,
    ) -> None:
        """Take the scheduler's counts of ``req_ids`` (one numpy pass over them);
        ``num_drafts_in_flight`` of each row's last step's drafts it counted as accepted (async
        scheduling), of which the rejected ones come off. A bad count changes no row."""
        index = self.req_id_to_index
        try:
            rows = np.array([index[req_id] for req_id in req_ids], dtype=np.int64)
        except KeyError as exc:
            raise ValueError(f"req_id {exc.args[0]!r} is not in the batch") from None
        computed = np.array(num_computed_tokens, dtype=np.int64)
        if num_drafts_in_flight and any(num_drafts_in_flight):
            computed = self.drafts.verified_num_computed(rows, computed, num_drafts_in_flight)
        held = self.num_tokens_no_spec[rows]
        bad = np.flatnonzero((computed < 0) | (computed > held))
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"num_computed_tokens of {req_ids[i]!r} must be in [0, {held[i]}], "
                f"got {computed[i]}"
            )
        self.num_computed_tokens[rows] = computed

    def set_num_scheduled_tokens(
        self,
        num_scheduled_tokens: np.ndarray,
        spec_decode_tokens: dict[str, list[int]] | None = None,
    ) -> None:
        """Take this step's token counts of rows ``0..num_reqs-1``, and the draft tokens in them.

        ``num_scheduled_tokens[i]`` counts row ``i``'s tokens this step, its drafts included; a
        row may be scheduled for 0 tokens, and then it samples nothing. The drafts are held
        after each row's tokens (``DraftSlots.schedule``: a row with fewer held drafts than
        placeholders runs fewer tokens); ``num_scheduled_tokens`` then holds the counts run.
        Counts that a row's tokens or blocks cannot hold are a ValueError that leaves no drafts
        behind.
        """
        self.check_condensed("set_num_scheduled_tokens")
        n = self.num_reqs
        num_sched = np.array(num_scheduled_tokens, dtype=np.int64)
        if num_sched.shape != (n,) or n == 0:
            raise ValueError(
                f"num_scheduled_tokens must have shape ({n},) with n > 0, "
                f"got {tuple(num_sched.shape)}"
            )
        try:
            self.drafts.schedule(spec_decode_tokens or {}, num_sched)
        except ValueError:
            self.drafts.drop()
            raise
        total = int(num_sched.sum())
        computed = self.num_computed_tokens[:n].astype(np.int64)
        # One reduction for every check (tokens held, room in the blocks, non-negative counts);
        # the error path works out which one failed.
        blocks = self.num_blocks[:n]
        if self.num_kv_groups > 1 or self.num_state_blocks:
            blocks = (blocks - self.num_state_blocks) // self.num_kv_groups
        capacity = np.minimum(self.num_tokens[:n], blocks * self.block_size)
        slack = np.minimum(capacity - computed - num_sched, num_sched)
        if total <= 0 or total > self.max_num_batched_tokens or slack.min() < 0:
            error = self._schedule_error(num_sched, computed, total)
            self.drafts.drop()
            raise error
        self.num_scheduled_tokens[:n] = num_sched

    def _schedule_error(
        self, num_sched: np.ndarray, computed: np.ndarray, total: int
    ) -> ValueError:
        n = len(num_sched)
        if (num_sched < 0).any() or total <= 0:
            return ValueError("num_scheduled_tokens must be non-negative with a positive sum")
        if total > self.max_num_batched_tokens:
            return ValueError(
                f"num_scheduled_tokens sum to {total}, more than max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )
        seq_lens = computed + num_sched
        over = np.flatnonzero(seq_lens > self.num_tokens[:n])
        if len(over):
            row = over[0]
            return ValueError(
                f"num_scheduled_tokens of {self._req_ids[row]!r}: {num_sched[row]} tokens after "
                f"{computed[row]} computed exceed the {self.num_tokens[row]} it holds"
            )
        needed = _cdiv(seq_lens, self.block_size) * self.num_kv_groups + self.num_state_blocks
        row = np.flatnonzero(needed > self.num_blocks[:n])[0]
        return ValueError(
            f"block_ids of {self._req_ids[row]!r}: {self.num_blocks[row]} blocks cannot hold "
            f"{seq_lens[row]} tokens"
        )

    def reached_end(self) -> np.ndarray:
        """Rows whose scheduled tokens reach the end of their known tokens (they sample)."""
        n = self.num_reqs
        scheduled = self.num_scheduled_tokens[:n]
        held = self.num_tokens_no_spec[:n]
        return (self.num_computed_tokens[:n] + scheduled >= held) & (scheduled > 0)

    def append_token_runs(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> None:
        """Append row ``i``'s ``token_ids[i, :num_tokens[i]]`` (its accepted drafts and one
        more, its one sampled token, or nothing mid-prefill), vectorized over the batch. The
        step's drafts are dropped, and requests that reached min_tokens leave the mask."""
        n = self.num_reqs
        counts = np.asarray(num_tokens, dtype=np.int64)
        if counts.shape != (n,) or token_ids.shape[0] != n:
            raise ValueError(f"sampled must have {n} rows, got shape {np.shape(token_ids)}")
        start = self.num_tokens_no_spec[:n].astype(np.int64)
        ends = start + counts
        if n and ends.max() > self.max_model_len:
            raise ValueError(f"sampled tokens would exceed max_model_len {self.max_model_len}")
        if n and not 0 <= counts.min() <= counts.max() <= token_ids.shape[1]:
            raise ValueError(f"num_tokens must lie in [0, {token_ids.shape[1]}] (the run width)")
        if token_ids.shape[1] == 1:  # one token per row at most: no runs to lay out
            rows = np.flatnonzero(counts)
            self.token_ids_cpu[rows, start[rows]] = token_ids[rows, 0]
        elif total := int(counts.sum()):
            rows = np.repeat(np.arange(n), counts)
            offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            self.token_ids_cpu[rows, start[rows] + offsets] = token_ids[rows, offsets]
        self.drafts.record_accepted(counts)
        self.num_tokens_no_spec[:n] = ends
        self.num_tokens[:n] = ends
        self.drafts.any = False
        self.min_tokens_stops.drop_reached(self.rows, self.req_id_to_index)

    def append_sampled_tokens(self, sampled: np.ndarray | list[list[int]]) -> list[list[int]]:
        """``append_token_runs`` from one token per row (an array of shape ``[num_reqs]`` or
        ``[num_reqs, 1]``: rows that do not reach the end of their tokens get none) or from
        each row's list of tokens; returns what each row received."""
        n = self.num_reqs
        if isinstance(sampled, list):
            if len(sampled) != n:
                raise ValueError(f"sampled must have {n} rows, got {len(sampled)}")
            counts = np.array([len(t) for t in sampled], dtype=np.int64)
            token_ids = np.zeros((n, max(int(counts.max(initial=0)), 1)), dtype=np.int64)
            for row, tokens in enumerate(sampled):
                token_ids[row, : len(tokens)] = tokens
        else:
            token_ids = np.asarray(sampled).reshape(-1, 1)
            if token_ids.shape != (n, 1):
                raise ValueError(f"sampled must have {n} rows, got shape {np.shape(sampled)}")
            counts = self.reached_end().astype(np.int64)
        self.append_token_runs(token_ids, counts)
        return [row[:c].tolist() for row, c in zip(token_ids, counts.tolist())]

    def min_tokens_stop_mask(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(rows, token_ids)`` to mask in this step's logits: EOS (unless ignore_eos) and the
        stop_token_ids of every row with fewer than ``min_tokens`` outputs, as int64 index
        arrays; None when no row has any. Reads the batch only."""
        return self.min_tokens_stops.mask(self.req_id_to_index)
