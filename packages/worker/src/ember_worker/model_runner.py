"""The model runner: turns one ``SchedulerOutput`` into sampled tokens.

Per step, as vLLM v1's GPU model runner: apply the scheduler's diff to the persistent batch
(drop finished and preempted requests, add new ones, append new blocks, take the scheduler's
computed-token counts), prepare flattened inputs with numpy, run the decoder over every scheduled
token at once, then one sampling path: logits at each request's last scheduled token (and at
each draft position of a request verifying drafts), the grammar bitmask, the sampler, the
rejection sampler over rows with drafts, the tokens appended to the batch (requests still in
prefill get none), the next drafts proposed, and the output.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import ember_kernels as ek
from ember_scheduler.lora import LoRAConfig
from ember_scheduler.outputs import Logprobs, ModelRunnerOutput, NewRequestData, SchedulerOutput
from ember_spec_decode import Proposal, SpeculativeConfig
from ember_worker.distributed.groups import SINGLE_STAGE, PipelineStage
from ember_worker.input_batch import InputBatch
from ember_worker.kv_cache import KVCacheSpec, allocate_kv_cache, copy_kv_blocks
from ember_worker.kv_connector import TieredConnectorWorker
from ember_worker.kv_specs import kv_cache_groups, layer_caches, state_groups
from ember_worker.layers.attention import AttentionMetadata, bind_kv_cache
from ember_worker.lora.manager import LoRAManager
from ember_worker.mamba_state import (
    MambaStateSlots,
    MambaStateSpec,
    allocate_mamba_state,
    bind_mamba_state,
)
from ember_worker.model_inputs import ModelInputBuffers, ModelInputs
from ember_worker.model_loader import LoadedModel
from ember_worker.pooler import Pooler
from ember_worker.sampler import Sampler
from ember_worker.sampling_metadata import SamplingMetadataBuilder
from ember_worker.spec_decode import SpeculativeDecoder
from ember_worker.step_threads import StepThreads
from ember_worker.step_tokens import StepTokens, logprobs_per_token, pack, unpack
from ember_worker.structured_outputs import GrammarMatchers, XGrammarCompiler


class ModelRunner:
    """Holds the model, its KV cache tensors and the persistent batch of one worker.

    Under pipeline parallelism (``pp``) a stage other than the first receives the previous
    stage's activations, a stage other than the last sends its own on and takes the sampled
    tokens and the next drafts from the last stage, so that every stage's batch holds the same
    tokens. Under tensor parallelism every rank samples the same tokens from the same logits
    (the ranks share a seed).
    ``step_threads`` sets torch's threads for each step by its scheduled tokens (None: leave
    them alone).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device,
        grammar_compiler: XGrammarCompiler | None = None,
        speculative_config: SpeculativeConfig | None = None,
        pp: PipelineStage = SINGLE_STAGE,
        step_threads: StepThreads | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.model = loaded.model
        self.step_threads = step_threads
        self.device = device
        self.pp = pp
        # Layers with different KV specs (Gemma's local and global) keep a table per group.
        self.kv_groups = kv_cache_groups(loaded.config)
        if len(self.kv_groups) > 1 and not (pp.is_first and pp.is_last):
            raise ValueError(
                "pipeline_parallel_size must be 1 for a model whose layers keep different KV "
                "(sliding-window and global layers)"
            )
        self.input_batch = InputBatch(
            max_num_reqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            vocab_size=loaded.config.vocab_size,
            device=device,
            num_kv_groups=len(self.kv_groups),
            num_state_blocks=len(state_groups(loaded.config)),
        )
        self.input_buffers = ModelInputBuffers(self.input_batch)
        self.sampler = Sampler()
        self.sampling_metadata = SamplingMetadataBuilder(self.input_batch)
        self.pooler = Pooler(loaded.config.hidden_size, getattr(self.model, "score", None))
        k = 0 if speculative_config is None else speculative_config.num_speculative_tokens
        self.num_speculative_tokens = k
        self.grammar_matchers = (
            None if grammar_compiler is None else GrammarMatchers(grammar_compiler, max_num_seqs, k)
        )
        # Only the last pipeline stage samples, so only it verifies and proposes (and holds a
        # draft model); the other stages take its tokens and drafts.
        self.spec_decoder = (
            None
            if speculative_config is None or not pp.is_last
            else SpeculativeDecoder(speculative_config, self.input_batch, loaded, device)
        )
        if len(self.kv_groups) > 1 and self.spec_decoder and self.spec_decoder.draft_model:
            raise ValueError(
                "speculative_config: a draft model is not supported beside a target whose "
                "layers keep different KV (sliding-window and global layers)"
            )
        self.kv_cache_spec = KVCacheSpec.for_model(loaded, block_size)
        # A Mamba hybrid's mixers keep a state per request in the batch (ember_worker.mamba_state).
        self.mamba_state_spec = MambaStateSpec.for_model(self.model)
        self.mamba_slots: MambaStateSlots | None = None
        self.max_num_seqs = max_num_seqs
        if self.mamba_state_spec is not None and speculative_config is not None:
            raise ValueError(
                "speculative_config: speculative decoding is not supported for a Mamba hybrid "
                "(its state cannot roll back rejected drafts)"
            )
        if self.mamba_state_spec is not None and lora_config is not None:
            raise ValueError("lora_config: LoRA is not supported for a Mamba hybrid (Bamba)")
        if len(self.kv_groups) > 1:  # layer j of every group shares cache tensor j
            largest = max(len(group.layer_ids) for group in self.kv_groups)
            self.kv_cache_spec = dataclasses.replace(self.kv_cache_spec, num_layers=largest)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._block_indexed_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_connector: TieredConnectorWorker | None = None
        self.lora_manager = (
            None
            if lora_config is None
            else LoRAManager(self.model, loaded.config, lora_config, loaded.dtype, device)
        )

    def num_kv_blocks_for(self, memory_bytes: int) -> int:
        """Blocks that ``memory_bytes`` hold, for the target's KV and a draft model's together
        (they share block ids)."""
        spec = self.kv_cache_spec
        if self.mamba_state_spec is not None:  # the states of max_num_seqs requests first
            states = self.max_num_seqs * self.mamba_state_spec.bytes_per_request
            if memory_bytes <= states:
                raise ValueError(
                    f"kv_cache_memory of {memory_bytes} bytes holds no KV block beside the Mamba "
                    f"states of max_num_seqs={self.max_num_seqs} requests ({states} bytes)"
                )
            return spec.num_blocks_for(memory_bytes - states)
        draft = self.spec_decoder.draft_model if self.spec_decoder is not None else None
        if draft is not None:
            per_block = spec.bytes_per_block + draft.kv_cache_spec.bytes_per_block
            return spec.num_blocks_for(memory_bytes * spec.bytes_per_block // per_block)
        return spec.num_blocks_for(memory_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.kv_cache_spec, num_blocks, self.device)
        if len(self.kv_groups) > 1:
            bind_kv_cache(self.model, *layer_caches(self.kv_caches, self.kv_groups))
        else:
            bind_kv_cache(self.model, self.kv_caches)
        if self.mamba_state_spec is not None:
            states = allocate_mamba_state(self.mamba_state_spec, self.max_num_seqs, self.device)
            bind_mamba_state(self.model, states)
            self.mamba_slots = MambaStateSlots(self.max_num_seqs, num_blocks, self.device)
        # Every cache indexed by the scheduler's block ids: block copies apply to all of them.
        self._block_indexed_caches = list(self.kv_caches)
        if self.spec_decoder is not None and self.spec_decoder.draft_model is not None:
            draft = self.spec_decoder.draft_model
            draft.initialize_kv_cache(num_blocks, self.device)
            self._block_indexed_caches += draft.kv_caches

    def register_kv_connector(self, connector: TieredConnectorWorker) -> None:
        """Move KV chunks between this runner's cache and a tier store (after initialize)."""
        connector.register_kv_caches(self.kv_caches)
        self.kv_connector = connector

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's outputs; on a pipeline stage other than the last, None, or with a KV
        connector an output holding only its connector's report."""
        with ek.cpu_ops.one_step():
            return self._execute_step(scheduler_output)

    def _execute_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        connector = self.kv_connector
        if connector is None:
            return self._execute_model(scheduler_output)
        connector.start_step(scheduler_output.kv_connector_metadata)
        output = self._execute_model(scheduler_output)
        if output is None:  # a stage before the last: it reports only its own transfers
            output = ModelRunnerOutput([], {}, [])
        idle = scheduler_output.total_num_scheduled_tokens == 0
        output.kv_connector_output = connector.finish_step(idle)
        return output

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        if spec_decode_tokens and not self.num_speculative_tokens:
            raise ValueError(
                "scheduled_spec_decode_tokens needs a model runner built with a speculative_config"
            )
        if scheduler_output.kv_block_copies:
            copy_kv_blocks(self._block_indexed_caches, scheduler_output.kv_block_copies)
        self._update_states(scheduler_output)
        batch = self.input_batch
        req_ids = batch.req_ids  # a copy: the batch's own list changes next step
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids, dict(batch.req_id_to_index), [[] for _ in req_ids])

        num_scheduled = np.zeros(batch.num_reqs, dtype=np.int32)
        index = batch.req_id_to_index
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            num_scheduled[index[req_id]] = count
        batch.set_num_scheduled_tokens(num_scheduled, spec_decode_tokens)
        num_scheduled = batch.num_scheduled_tokens[: batch.num_reqs]  # less unheld drafts
        if self.step_threads is not None:
            self.step_threads.apply(int(num_scheduled.sum()))
        inputs = self.input_buffers.prepare()
        if self.lora_manager is not None:
            self.lora_manager.prepare_step(batch.rows["lora_id"][: batch.num_reqs], num_scheduled)
        metadata = _attention_metadata(inputs, self.kv_connector)
        if self.mamba_slots is not None:
            metadata.state_slots = self.mamba_slots.slots(inputs.state_blocks)
        hidden_states = self._forward(inputs, metadata)
        samples = len(self.pooler.params) < batch.num_reqs
        if hidden_states is None:  # an earlier pipeline stage: the last one samples
            if samples:
                self._record_tokens(None)
            return None
        if self.spec_decoder is not None:
            self.spec_decoder.catch_up(inputs, metadata)
        pooler_output = {}
        if self.pooler.params:
            pooler_output = self.pooler.pool(hidden_states, batch, num_scheduled)
        if not samples:  # pooling requests only: no sampling
            no_tokens = [[] for _ in req_ids]
            return ModelRunnerOutput(req_ids, dict(index), no_tokens, pooler_output=pooler_output)

        prompt_logprobs = self._prompt_logprobs(hidden_states, num_scheduled)
        tokens, logprobs = self._sample(hidden_states, inputs)
        sampled, drafts = self._record_tokens(tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=dict(index),
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            spec_token_ids=None if drafts is None else drafts.to_lists(),
            pooler_output=pooler_output,
        )

    def _sample(
        self, hidden_states: torch.Tensor, inputs: ModelInputs
    ) -> tuple[StepTokens, Logprobs | None]:
        """The one sampling path: logits, grammar bitmask, sampler, and the rejection sampler
        over the rows that verify drafts (their logits sit at each draft position too)."""
        batch = self.input_batch
        spec = self.spec_decoder
        layout = None if spec is None else spec.layout()
        if layout is None and inputs.num_tokens == batch.num_reqs and inputs.max_query_len == 1:
            last = hidden_states  # one token per row: every token's logits are sampled
        else:
            indices = inputs.logits_indices if layout is None else layout.logits_indices
            last = hidden_states[indices.to(hidden_states.device)]
        logits = self.model.compute_logits(last)
        index = batch.req_id_to_index
        if self.grammar_matchers and layout is None:
            self.grammar_matchers.apply_bitmask(logits, index)
        elif self.grammar_matchers:
            self.grammar_matchers.apply_bitmask_with_drafts(
                logits, index, layout.first_rows, layout.drafts_by_request(batch)
            )
        last_logits = logits if layout is None else logits[layout.last_index]
        sampler_output = self.sampler(last_logits, self.sampling_metadata.build())
        width = 1 + self.num_speculative_tokens
        tokens = StepTokens.one_per_row(
            sampler_output.sampled_token_ids, batch.reached_end(), width
        )
        if layout is not None:
            spec_rows, target_logits = spec.verify(logits, layout, tokens)
        if sampler_output.logprobs is None:
            return tokens, None
        runs = tokens.to_lists()
        logprobs = logprobs_per_token(sampler_output, runs)
        if layout is not None:
            num_drafts = layout.num_drafts[spec_rows]
            spec.fill_draft_logprobs(logprobs, runs, target_logits, spec_rows, num_drafts)
        return tokens, logprobs

    def _record_tokens(self, tokens: StepTokens | None) -> tuple[list[list[int]], Proposal | None]:
        """Append the step's tokens to the batch, advance the grammars and hold the next drafts.

        The last stage passes the tokens it sampled and proposes the drafts; under pipeline
        parallelism it then sends both to every other stage, which passes None here.
        """
        batch = self.input_batch
        spec = self.spec_decoder
        k = self.num_speculative_tokens
        drafts = None
        if tokens is None:
            shape = (batch.num_reqs, 3 + 2 * k)
            packed = torch.empty(shape, dtype=torch.int64, device=self.device)
            tokens, drafts = unpack(self.pp.share_from_last(packed), 1 + k, k)
        else:
            for req_id in self.pooler.params:  # rows sampled alongside, for nothing
                tokens.num_tokens[batch.req_id_to_index[req_id]] = 0
        batch.append_token_runs(tokens.token_ids, tokens.num_tokens)
        sampled = tokens.to_lists()
        if self.grammar_matchers:
            self.grammar_matchers.accept_sampled(batch.req_id_to_index, sampled)
        if not self.pp.is_last:
            if drafts is not None:
                batch.drafts.hold(drafts.draft_token_ids, drafts.num_draft_tokens)
            return sampled, drafts
        if spec is not None:
            drafts = spec.propose(tokens, self.grammar_matchers)
        if self.pp.size > 1:
            self.pp.share_from_last(pack(tokens, drafts, k).to(self.device))
        return sampled, drafts

    def _forward(self, inputs: ModelInputs, metadata: AttentionMetadata) -> torch.Tensor | None:
        """The last stage's hidden states; other stages send their activations on, return None."""
        intermediate = None
        if not self.pp.is_first:
            shape = (inputs.input_ids.shape[0], self.model.config.hidden_size)
            dtype = self.kv_cache_spec.dtype
            intermediate = self.pp.recv(
                tuple(torch.empty(shape, dtype=dtype, device=self.device) for _ in range(2))
            )
        out = self.model(inputs.input_ids, inputs.positions, metadata, intermediate)
        if self.pp.is_last:
            return out
        self.pp.send(out)
        return None

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            batch.remove_request(req_id)
            self.pooler.remove_request(req_id)
            if self.mamba_slots is not None:
                self.mamba_slots.release(req_id)
            if self.grammar_matchers is not None:
                self.grammar_matchers.remove_request(req_id)
        for new_req in scheduler_output.scheduled_new_reqs:
            batch.add_request(new_req)
            if self.mamba_slots is not None:  # its state block leads its block ids
                self.mamba_slots.assign(new_req.req_id, new_req.block_ids[0])
            if new_req.lora_request is not None:
                self._lora_manager_for(new_req.req_id).add_request(new_req.lora_request)
            if new_req.pooling_params is not None:
                self.pooler.add_request(new_req.req_id, new_req.pooling_params)
            if new_req.sampling_params.structured_outputs is not None:
                self._add_grammar_matcher(new_req)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_block_ids:
                batch.append_block_ids(req_id, new_block_ids)
        if cached.req_ids:
            batch.set_num_computed_tokens_of(
                cached.req_ids, cached.num_computed_tokens, cached.num_drafts_in_flight
            )
        batch.condense()

    def _lora_manager_for(self, req_id: str) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError(f"request {req_id!r} has a lora_request, but LoRA is not enabled")
        return self.lora_manager

    def _add_grammar_matcher(self, new_req: NewRequestData) -> None:
        """A matcher for a constrained request; its grammar ends at its EOS or stop tokens."""
        if self.grammar_matchers is None and not self.pp.is_last:
            return  # a stage before the last samples nothing
        if self.grammar_matchers is None:
            raise ValueError(
                f"request {new_req.req_id!r} has structured_outputs, but this model runner has "
                "no grammar compiler"
            )
        params = new_req.sampling_params
        end_tokens = [new_req.eos_token_id] if new_req.eos_token_id is not None else []
        end_tokens += [t for t in params.stop_token_ids if t not in end_tokens]
        self.grammar_matchers.add_request(
            new_req.req_id, params.structured_outputs, end_tokens, new_req.output_token_ids
        )

    def _prompt_logprobs(
        self, hidden_states: torch.Tensor, num_scheduled: np.ndarray
    ) -> dict[str, Logprobs]:
        """Logprobs of the next prompt token at each prompt position scheduled this step, for
        requests that asked (``prompt_logprobs``); the last prompt position has no target."""
        batch = self.input_batch
        n = batch.num_reqs
        state = batch.rows[:n]
        asked = state["num_prompt_logprobs"]
        result: dict[str, Logprobs] = {}
        if asked.max(initial=-1) < 0:
            return result
        rows = np.flatnonzero((asked >= 0) & (num_scheduled > 0))
        if rows.size == 0:
            return result
        # Each row's first token in the flat batch, from the host counts (no device read-back).
        starts = np.cumsum(num_scheduled) - num_scheduled
        for row in rows.tolist():
            first = int(state["num_computed_tokens"][row])
            end = min(first + int(num_scheduled[row]), int(state["num_prompt_tokens"][row]) - 1)
            if end <= first:
                continue
            positions = np.arange(first, end)
            hidden = hidden_states[int(starts[row]) : int(starts[row]) + len(positions)]
            targets = torch.from_numpy(batch.token_ids_cpu[row, positions + 1].astype(np.int64))
            result[batch.req_ids[row]] = Sampler.compute_prompt_logprobs(
                self.model.compute_logits(hidden),
                targets.to(hidden.device),
                int(state["num_prompt_logprobs"][row]),
            )
        return result


def _attention_metadata(
    inputs: ModelInputs, kv_connector: TieredConnectorWorker | None
) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        block_table=inputs.block_table,
        query_start_loc=inputs.query_start_loc,
        seq_lens=inputs.seq_lens,
        max_query_len=inputs.max_query_len,
        max_seq_len=inputs.max_seq_len,
        kv_connector=kv_connector,
        group_tables=inputs.group_tables,
    )
