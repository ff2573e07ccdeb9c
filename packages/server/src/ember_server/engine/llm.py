"""The offline API: ``LLM(model, **engine_args).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from ember_scheduler.lora import LoRARequest
from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    eos_token_ids,
    finished_sequences,
)
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.engine_factory import make_engine_core
from ember_server.engine.input_processor import InputProcessor, TokenizedPrompt
from ember_server.engine.metrics import EngineMetrics, IterationStats
from ember_server.engine.model_config import ModelConfig
from ember_server.engine.output_processor import OutputProcessor
from ember_server.engine.outputs import RequestOutput, RequestOutputKind
from ember_server.engine.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
)
from ember_server.engine.scoring import score_pairs
from ember_server.engine.tokenizer import load_tokenizer


class LLM:
    """An engine in this process (no sockets) for batch generation.

    ``LLM(model, **engine_args)`` takes ``EngineArgs`` fields as keywords. ``generate`` and
    ``chat`` return one ``RequestOutput`` per prompt, in input order; ``embed``, ``classify``,
    ``encode`` and ``score`` return pooling outputs (``runner="pooling"`` serves only these; a
    generate runner embeds too).
    """

    def __init__(self, model: str, **engine_args) -> None:
        self.engine_args = EngineArgs(model=model, **engine_args)
        if self.engine_args.data_parallel_size != 1:
            raise ValueError(
                "LLM runs one engine core in this process: data_parallel_size > 1 is served by "
                "`ember serve -dp N` (AsyncLLM)"
            )
        self.model_config = ModelConfig.from_engine_args(self.engine_args)
        self.tokenizer = load_tokenizer(self.model_config.tokenizer)
        self.engine_core, self.model_config = make_engine_core(
            self.engine_args, self.model_config, served=False
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.model_config,
            max_num_kv_tokens=self.engine_core.max_num_tokens,
            lora_config=self.engine_args.lora_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(self.model_config.served_model_name)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (strings, token-id lists, or dicts with
        ``"prompt"`` or ``"prompt_token_ids"``); ``sampling_params`` is one for all, or one per
        prompt, and so is ``lora_request`` (None: the base model; needs ``enable_lora``)."""
        prompts = _as_prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        return self._generate(prompts, sampling_params, use_tqdm, priority, loras)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or a
        list of conversations, rendered through the tokenizer's chat template; ``lora_request``
        as ``generate``'s."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[TokenizedPrompt] = [
            self.input_processor.tokenize_chat(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            for conversation in conversations
        ]
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        return self._generate(prompts, sampling_params, use_tqdm, None, loras)

    def encode(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """Pool each prompt (``PoolingParams``: one for all, or one per prompt; default: embed)."""
        prompts = _as_prompt_list(prompts)
        if not prompts:
            raise ValueError("prompts must not be empty")
        params_list = [
            PoolingParams() if params is None else params
            for params in _per_prompt(pooling_params, len(prompts), "pooling_params")
        ]
        requests = []
        for prompt, params in zip(prompts, params_list):
            ids = self.input_processor.tokenize(prompt).token_ids
            request_id = str(next(self._request_counter))
            requests.append(self.input_processor.make_pooling_request(request_id, ids, params))
        order = {request.request_id: i for i, request in enumerate(requests)}
        for request in requests:
            self.output_processor.add_pooling_request(request)
        return self._submit_and_run(order, requests, use_tqdm)

    def embed(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``), pooled by the engine's
        ``pooling_type`` unless ``pooling_params`` says otherwise, L2-normalized by default."""
        params = _with_task(pooling_params, "embed")
        return [
            EmbeddingRequestOutput.from_base(o)
            for o in self.encode(prompts, params, use_tqdm=use_tqdm)
        ]

    def classify(
        self,
        prompts,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``.outputs.probs``), from a sequence classifier."""
        params = _with_task(pooling_params, "classify")
        return [
            ClassificationRequestOutput.from_base(o)
            for o in self.encode(prompts, params, use_tqdm=use_tqdm)
        ]

    def score(self, text_1, text_2, *, use_tqdm: bool = True):
        """Similarity of text pairs (one to one, one to many, or pairwise lists): a one-label
        classifier reads each pair as one input (cross-encoder); an embedding model gives the
        cosine similarity of the two embeddings. Returns ``ScoringRequestOutput``s in pair order.
        """
        return score_pairs(
            self.model_config, self.input_processor.text_encoder, text_1, text_2,
            lambda prompts, params: self.encode(prompts, params, use_tqdm=use_tqdm),
        )  # fmt: skip

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search over ``prompts`` (texts, token id lists or prompt dicts): a loop of
        one-token steps over every live beam of every prompt, outside the engine core
        (``engine/beam_search.py``); the best ``params.beam_width`` sequences of each prompt."""
        eos = eos_token_ids(self.model_config)
        searches = [
            BeamSearch(self.input_processor.tokenize(prompt).token_ids, params, eos)
            for prompt in _as_prompt_list(prompts)
        ]
        step = params.step_params()
        while live := [search for search in searches if not search.done]:
            beams = [beam.tokens for search in live for beam in search.live]
            outputs = iter(self.generate(beams, step, use_tqdm=False))
            for search in live:
                search.advance([next(outputs).outputs[0].logprobs[0] for _ in search.live])
        return [finished_sequences(search, self.get_tokenizer()) for search in searches]

    def _generate(
        self, prompts, sampling_params, use_tqdm, priority, loras=None
    ) -> list[RequestOutput]:
        if not prompts:
            raise ValueError("prompts must not be empty")
        params_list = [
            SamplingParams() if params is None else params
            for params in _per_prompt(sampling_params, len(prompts), "sampling_params")
        ]
        priorities = _per_prompt(priority, len(prompts), "priority") if priority else None
        # Check and tokenize everything before the engine sees any of it.
        batch = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            prompt = self.input_processor.tokenize(prompt)
            request_id = str(next(self._request_counter))
            engine_requests = self.input_processor.make_requests(
                request_id,
                prompt.token_ids,
                params,
                priorities[i] if priorities else 0,
                lora_request=loras[i] if loras else None,
            )
            batch.append((request_id, prompt.text, params, engine_requests))
        order = {}
        for i, (request_id, text, params, engine_requests) in enumerate(batch):
            self.output_processor.add_request(
                request_id, text, params, engine_requests, RequestOutputKind.FINAL_ONLY
            )
            order[request_id] = i
        requests = [request for *_, engine_requests in batch for request in engine_requests]
        return self._submit_and_run(order, requests, use_tqdm)

    def _submit_and_run(self, order: dict[str, int], requests: list, use_tqdm: bool) -> list:
        """Add the engine requests, step until every front-end request in ``order`` finished,
        and return their outputs in ``order``; on any exception, abort the unfinished ones."""
        results = [None] * len(order)
        try:
            for request in requests:
                self.engine_core.add_request(request)
            self._run_engine(order, results, use_tqdm)
        except BaseException:
            self._abort_unfinished(order)
            raise
        return results

    def _run_engine(self, order: dict[str, int], results: list, use_tqdm: bool) -> None:
        progress = tqdm(
            total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        num_output_tokens = 0
        with progress:
            while self.output_processor.has_unfinished_requests():
                if not self.engine_core.has_unfinished_requests():
                    raise RuntimeError(
                        "the engine core finished requests the front end still holds"
                    )
                outputs = self.engine_core.step()
                stats = IterationStats()
                processed = self.output_processor.process_outputs(outputs.outputs, stats)
                if processed.request_errors:  # the batch fails; its other requests are aborted
                    request_id, reason = next(iter(processed.request_errors.items()))
                    raise ValueError(f"the engine refused prompt {order[request_id]}: {reason}")
                if processed.reqs_to_abort:
                    self.engine_core.abort_requests(processed.reqs_to_abort)
                if outputs.scheduler_stats is not None:
                    self.metrics.record_scheduler_stats(outputs.scheduler_stats)
                self.metrics.record_iteration(stats)
                num_output_tokens += stats.num_generation_tokens
                for output in processed.request_outputs:
                    results[order[output.request_id]] = output
                    progress.update(1)
                if processed.request_outputs and use_tqdm:
                    elapsed = progress.format_dict["elapsed"] or 1e-9
                    progress.set_postfix_str(f"output {num_output_tokens / elapsed:.1f} tok/s")
        # A KV connector may still save what finished requests computed: finish that too, so
        # that it is stored when this call returns.
        while self.engine_core.has_unfinished_requests():
            outputs = self.engine_core.step()
            if outputs.scheduler_stats is not None:
                self.metrics.record_scheduler_stats(outputs.scheduler_stats)

    def _abort_unfinished(self, order: dict[str, int]) -> None:
        engine_ids, _ = self.output_processor.abort_requests(list(order))
        if engine_ids:
            self.engine_core.abort_requests(engine_ids)

    def shutdown(self) -> None:
        """Release the model and the KV cache."""
        self.engine_core.shutdown()


def _as_prompt_list(prompts) -> list:
    """One prompt or a list of prompts -> a list of str | list[int]."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts must be a string, token ids or a list of them, got {type(prompts).__name__}"
        )
    result = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompts[{i}] must hold 'prompt' or 'prompt_token_ids'")
        result.append(prompt)
    return result


def _per_prompt(value, count: int, name: str) -> list:
    if value is None or not isinstance(value, Sequence):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name} must be one value or one per prompt ({count}), got {len(value)}")
    return list(value)


def _with_task(pooling_params, task: str):
    """``pooling_params`` (one, a list, or None) for ``task``; a mismatching task is an error."""
    if pooling_params is None:
        return PoolingParams(task=task)
    for params in pooling_params if isinstance(pooling_params, Sequence) else [pooling_params]:
        if isinstance(params, PoolingParams) and params.task != task:
            raise ValueError(f"PoolingParams.task must be {task!r} here, got {params.task!r}")
    return pooling_params
