"""``POST /v1/chat/completions``: the conversation through the chat template, then one request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ember_server.openai.errors import OpenAIError, error_body
from ember_server.openai.logprobs import chat_logprobs
from ember_server.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from ember_server.openai.serving import OpenAIServing
from ember_server.openai.sse import DONE, MEDIA_TYPE, sse_event
from ember_server.openai.streams import ClientDisconnected, until_disconnect
from ember_server.outputs import CompletionOutput, RequestOutput

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    """Handler of the chat completions route."""

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        self.check_request(request)
        token_ids = self.encode_chat(request)
        if not token_ids:
            raise OpenAIError("messages render to an empty prompt", 400, "messages")
        max_tokens = self.max_tokens_for(request.requested_max_tokens, len(token_ids), None)
        params = self.sampling_params(request.to_sampling_params, max_tokens)
        request_id = random_id("chatcmpl")
        outputs = self.generate(token_ids, params, request_id, request.priority, request.stream)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, len(token_ids), outputs), media_type=MEDIA_TYPE
            )
        try:
            final = await until_disconnect(self._last(outputs), raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise self.engine_failure(exc) from exc
        return JSONResponse(self._response(request, request_id, final).model_dump())

    @staticmethod
    async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        final = None
        async for final in outputs:  # noqa: B007 - only the final output is wanted
            pass
        return final

    def _logprobs(
        self, request: ChatCompletionRequest, output: CompletionOutput
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs:
            return None
        return chat_logprobs(
            output.token_ids, output.logprobs or [], request.top_logprobs or 0, self.token_text
        )

    def _response(
        self, request: ChatCompletionRequest, request_id: str, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=output.index,
                message=ChatResponseMessage(role=ROLE, content=output.text),
                logprobs=self._logprobs(request, output),
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
            )
            for output in sorted(final.outputs, key=lambda o: o.index)
        ]
        usage = UsageInfo.of(
            len(final.prompt_token_ids), sum(len(o.token_ids) for o in final.outputs)
        )
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt_tokens: int,
        outputs: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        completion_tokens = 0
        finished: set[int] = set()
        continuous = request.include_usage and request.stream_options.continuous_usage_stats

        def chunk(choices, usage=None) -> str:
            return sse_event(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.model_name,
                    choices=choices,
                    usage=usage,
                )
            )

        try:
            for index in range(request.n):
                role = DeltaMessage(role=ROLE, content="")
                yield chunk([ChatCompletionResponseStreamChoice(index=index, delta=role)])
            async for delta in outputs:
                for output in delta.outputs:
                    if output.index in finished:
                        continue
                    completion_tokens += len(output.token_ids)
                    wants_logprobs = request.logprobs and output.token_ids
                    if not (output.text or output.finish_reason or wants_logprobs):
                        continue
                    if output.finish_reason is not None:
                        finished.add(output.index)
                    choice = ChatCompletionResponseStreamChoice(
                        index=output.index,
                        delta=DeltaMessage(content=output.text),
                        logprobs=self._logprobs(request, output),
                        finish_reason=output.finish_reason,
                        stop_reason=output.stop_reason,
                    )
                    usage = UsageInfo.of(prompt_tokens, completion_tokens) if continuous else None
                    yield chunk([choice], usage)
            if request.include_usage:
                yield chunk([], UsageInfo.of(prompt_tokens, completion_tokens))
        except Exception as exc:
            error = self.engine_failure(exc)
            yield sse_event(error_body(error.message, error.status, error.param))
        yield DONE
