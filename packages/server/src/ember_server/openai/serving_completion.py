"""``POST /v1/completions``: one engine request per prompt, answered whole or as SSE chunks."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.input_processor import TokenizedPrompt
from ember_server.engine.outputs import CompletionOutput, RequestOutput
from ember_server.openai.errors import error_body
from ember_server.openai.logprobs import completion_logprobs, vllm_prompt_logprobs
from ember_server.openai.protocol import UsageInfo, random_id
from ember_server.openai.protocol_completion import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from ember_server.openai.serving import OpenAIServing
from ember_server.openai.serving_beam_search import beam_search_completion
from ember_server.openai.sse import DONE, MEDIA_TYPE, StreamEvents, sse_event, text_choice
from ember_server.openai.streams import ClientDisconnected, merge_async_iterators, until_disconnect

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the completions API


@dataclasses.dataclass
class _Prompt:
    text: str  # what echo puts before the completion
    prompt: TokenizedPrompt
    params: SamplingParams

    @property
    def token_ids(self) -> list[int]:
        return self.prompt.token_ids


class OpenAIServingCompletion(OpenAIServing):
    """Handler of the completions route."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        lora = self.check_request(request, adapters=True)
        prompts = [await self._prepare(request, prompt) for prompt in request.prompts()]
        request_id = random_id("cmpl")
        if request.use_beam_search:
            return await beam_search_completion(self, request, prompts, request_id, raw_request)
        streams = []
        try:
            for i, p in enumerate(prompts):
                streams.append(
                    self.generate(
                        p.prompt,
                        p.params,
                        f"{request_id}-{i}",
                        request.priority,
                        request.stream,
                        request.structured_field,
                        timeout=request.timeout,
                        lora_request=lora,
                    )
                )
        except Exception:  # a later prompt refused: the ones already sent are withdrawn
            for stream in streams:
                await stream.aclose()
            raise
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, prompts, streams), media_type=MEDIA_TYPE
            )
        try:
            finals = await until_disconnect(self._collect(streams), raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise self.engine_failure(exc) from exc
        return JSONResponse(self._response(request, request_id, prompts, finals).model_dump())

    async def _prepare(self, request: CompletionRequest, prompt: str | list[int]) -> _Prompt:
        tokenized = await self.prompt(prompt, request.add_special_tokens, "prompt")
        if isinstance(prompt, str):
            text = prompt
        else:
            text = self.tokenizer.decode(tokenized.token_ids) if request.echo else ""
        max_tokens = self.max_tokens_for(
            request.max_tokens, len(tokenized.token_ids), DEFAULT_MAX_TOKENS
        )
        return _Prompt(
            text, tokenized, self.sampling_params(request.to_sampling_params, max_tokens)
        )

    @staticmethod
    async def last_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        final = None
        async for final in stream:  # noqa: B007 - only the final output is wanted
            pass
        return final

    @staticmethod
    async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, output in merge_async_iterators(*streams):
            finals[index] = output
        return finals  # type: ignore[return-value]

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        completion_tokens = 0
        for prompt_index, (prompt, final) in enumerate(zip(prompts, finals)):
            for output in sorted(final.outputs, key=lambda o: o.index):
                if request.max_tokens == 0:  # the token generated for the prompt's sake
                    output = dataclasses.replace(
                        output, text="", token_ids=[], logprobs=[], finish_reason="length"
                    )
                completion_tokens += len(output.token_ids)
                prefix = prompt.text if request.echo else ""
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_index * request.n + output.index,
                        text=prefix + output.text,
                        logprobs=self._logprobs(request, prompt, final, output, len(prefix)),
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                        prompt_logprobs=self._prompt_logprobs(request, final),
                    )
                )
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        cached_tokens = sum(final.num_cached_tokens for final in finals)
        usage = UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens)
        return CompletionResponse(
            id=request_id, model=self.response_model(request), choices=choices, usage=usage
        )

    def _logprobs(
        self,
        request: CompletionRequest,
        prompt: _Prompt,
        final: RequestOutput,
        output: CompletionOutput,
        text_offset: int,
    ) -> CompletionLogProbs | None:
        """A whole choice's logprobs: with ``echo``, the prompt's tokens first (the engine's
        prompt logprobs; the first token's are None), then the generated ones; text offsets
        count the tokens' text."""
        if request.logprobs is None:
            return None
        as_ids = request.return_tokens_as_token_ids
        echoed = None
        if request.echo:  # offsets then run on over the prompt tokens' text (BOS included)
            echoed, text_offset = completion_logprobs(
                prompt.token_ids,
                final.prompt_logprobs or [],
                request.logprobs,
                0,
                self.token_text,
                as_ids,
            )
        generated, _ = completion_logprobs(
            output.token_ids,
            output.logprobs or [],
            request.logprobs,
            text_offset,
            self.token_text,
            as_ids,
        )
        if echoed is None:
            return generated
        for name in CompletionLogProbs.model_fields:
            getattr(echoed, name).extend(getattr(generated, name))
        return echoed

    def _prompt_logprobs(self, request: CompletionRequest, final: RequestOutput):
        if request.prompt_logprobs is None or final.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(final.prompt_logprobs, self.token_text)

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        streams: list[AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[str]:
        events = StreamEvents(
            CompletionStreamResponse, request_id, int(time.time()), self.response_model(request)
        )
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion_tokens = 0
        text_offsets: dict[int, int] = {}
        cached: dict[int, int] = {}  # prompt index -> its prefix-cache hit tokens
        finished: set[int] = set()
        continuous = request.include_usage and request.stream_options.continuous_usage_stats
        try:
            async for prompt_index, delta in merge_async_iterators(*streams):
                cached[prompt_index] = delta.num_cached_tokens
                for output in delta.outputs:
                    index = prompt_index * request.n + output.index
                    if index in finished:
                        continue
                    if request.max_tokens == 0:  # the token generated for the prompt's sake
                        reason = output.finish_reason and "length"
                        output = dataclasses.replace(
                            output, text="", token_ids=[], logprobs=[], finish_reason=reason
                        )
                    completion_tokens += len(output.token_ids)
                    text = output.text
                    if index not in text_offsets:
                        text_offsets[index] = 0
                        if request.echo:
                            text = prompts[prompt_index].text + text
                    # A chunk for every output with new tokens, even ones that render as no
                    # text yet (held-back partial UTF-8 or stop-string text, special tokens):
                    # clients time the first token and the gaps between tokens by them.
                    if not (text or output.token_ids or output.finish_reason):
                        continue
                    if request.logprobs is None:
                        choice = text_choice(index, text, output.finish_reason, output.stop_reason)
                    else:
                        logprobs, text_offsets[index] = completion_logprobs(
                            output.token_ids,
                            output.logprobs or [],
                            request.logprobs,
                            text_offsets[index],
                            self.token_text,
                            request.return_tokens_as_token_ids,
                        )
                        choice = CompletionResponseStreamChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=output.finish_reason,
                            stop_reason=output.stop_reason,
                        )
                    if output.finish_reason is not None:
                        finished.add(index)
                    usage = None
                    if continuous:
                        usage = UsageInfo.of(prompt_tokens, completion_tokens, sum(cached.values()))
                    yield events.chunk([choice], usage)
            if request.include_usage:
                usage = UsageInfo.of(prompt_tokens, completion_tokens, sum(cached.values()))
                yield events.chunk([], usage)
        except Exception as exc:
            error = self.engine_failure(exc)
            yield sse_event(error_body(error.message, error.status, error.param))
        yield DONE
