"""``POST /v1/chat/completions``: the conversation through the chat template, then one request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ember_server.engine.outputs import CompletionOutput, RequestOutput
from ember_server.openai.chat_stream import ChoiceStream
from ember_server.openai.errors import OpenAIError, error_body
from ember_server.openai.logprobs import chat_logprobs
from ember_server.openai.protocol import UsageInfo, random_id
from ember_server.openai.protocol_chat import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
)
from ember_server.openai.reasoning import reasoning_parser as get_reasoning_parser
from ember_server.openai.serving import OpenAIServing
from ember_server.openai.sse import DONE, MEDIA_TYPE, StreamEvents, content_choice, sse_event
from ember_server.openai.streams import ClientDisconnected, until_disconnect
from ember_server.openai.tool_calls import (
    TOOL_CALL_PARSERS,
    TOOL_CALLS,
    NamedCallStream,
    ParsedCallStream,
    RequiredCallStream,
    forced_tool_call,
)

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
    """Handler of the chat completions route.

    ``tool_call_parser`` (a name in ``TOOL_CALL_PARSERS``) parses calls out of the text of
    requests with tools and ``tool_choice`` auto; without it such requests get a 400. Forced
    calls (``required``, a named function) need no parser: a grammar shapes their output.
    ``reasoning_parser`` (a name in ``reasoning.REASONING_PARSERS``) splits the model's thinking
    into ``reasoning_content``, except from outputs a forced call or ``response_format`` shapes
    (their grammar leaves no room for thinking).
    """

    def __init__(
        self, engine, tool_call_parser: str | None = None, reasoning_parser: str | None = None
    ) -> None:
        super().__init__(engine)
        self.reasoning_parser = get_reasoning_parser(reasoning_parser)
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, "
                f"got {tool_call_parser!r}"
            )
        self.tool_parser = TOOL_CALL_PARSERS[tool_call_parser]() if tool_call_parser else None

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        request_id = random_id("chatcmpl")
        num_prompt_tokens, outputs = await self.submit(request, request_id)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, num_prompt_tokens, outputs),
                media_type=MEDIA_TYPE,
            )
        try:
            final = await until_disconnect(self.last(outputs), raw_request)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            raise self.engine_failure(exc) from exc
        return JSONResponse(self._response(request, request_id, final).model_dump())

    async def submit(
        self, request: ChatCompletionRequest, request_id: str
    ) -> tuple[int, AsyncIterator[RequestOutput]]:
        """Check ``request``, render its prompt and start generating: the prompt's length and
        the outputs (the other chat-shaped routes, Anthropic's Messages, start here too)."""
        lora = self.check_request(request, adapters=True)
        if self._parses_calls(request) and self.tool_parser is None:
            raise OpenAIError(
                'tools with tool_choice "auto" need the server started with --tool-call-parser',
                400,
                "tool_choice",
            )
        prompt = await self.chat_prompt(request)
        num_prompt_tokens = len(prompt.token_ids)
        max_tokens = self.max_tokens_for(request.requested_max_tokens, num_prompt_tokens, None)
        params = self.sampling_params(request.to_sampling_params, max_tokens)
        outputs = self.generate(
            prompt,
            params,
            request_id,
            request.priority,
            request.stream,
            request.structured_field,
            timeout=request.timeout,
            lora_request=lora,
        )
        return num_prompt_tokens, outputs

    @staticmethod
    async def last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
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
            output.token_ids,
            output.logprobs or [],
            request.top_logprobs or 0,
            self.token_text,
            request.return_tokens_as_token_ids,
        )

    @staticmethod
    def _parses_calls(request: ChatCompletionRequest) -> bool:
        """Whether calls are parsed out of free text (tools given, ``tool_choice`` auto)."""
        return bool(request.tools) and request.tool_choice in (None, "auto")

    def _parses_reasoning(self, request: ChatCompletionRequest) -> bool:
        shaped = request.structured_field in ("tools", "response_format")
        return self.reasoning_parser is not None and not shaped

    def message(
        self, request: ChatCompletionRequest, output: CompletionOutput
    ) -> tuple[ChatResponseMessage, str | None]:
        """The message of a finished choice, and its finish reason (``tool_calls`` for calls)."""
        text, finish_reason = output.text, output.finish_reason
        reasoning = None
        if self._parses_reasoning(request):
            reasoning, text = self.reasoning_parser.split(text)
            if reasoning is not None and not text:
                text = None
        call = forced_tool_call(request, text) if request.forces_tool_call else None
        if call is not None and finish_reason == "stop":
            return ChatResponseMessage(role=ROLE, tool_calls=[call]), TOOL_CALLS
        if self._parses_calls(request) and text:
            content, calls = self.tool_parser.parse(text, request.tools)
            if calls:
                reason = TOOL_CALLS if finish_reason == "stop" else finish_reason
                message = ChatResponseMessage(
                    role=ROLE, content=content, tool_calls=calls, reasoning_content=reasoning
                )
                return message, reason
        message = ChatResponseMessage(role=ROLE, content=text, reasoning_content=reasoning)
        return message, finish_reason

    def choice_stream(self, request: ChatCompletionRequest) -> ChoiceStream | None:
        """The stream of one choice, or None when its text streams as content as it is."""
        reasoning = self.reasoning_parser.stream() if self._parses_reasoning(request) else None
        calls = self.call_stream(request)
        if reasoning is None and calls is None:
            return None
        return ChoiceStream(reasoning, calls)

    def call_stream(self, request: ChatCompletionRequest):
        """The tool-call stream of one choice, or None when its text streams as it is."""
        if request.forced_function is not None:
            return NamedCallStream(request.forced_function)
        if request.forces_tool_call:
            return RequiredCallStream(request)
        if self._parses_calls(request):
            return ParsedCallStream(self.tool_parser, request.tools)
        return None

    def _response(
        self, request: ChatCompletionRequest, request_id: str, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = []
        for output in sorted(final.outputs, key=lambda o: o.index):
            message, finish_reason = self.message(request, output)
            choices.append(
                ChatCompletionResponseChoice(
                    index=output.index,
                    message=message,
                    logprobs=self._logprobs(request, output),
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason,
                )
            )
        usage = UsageInfo.of(
            len(final.prompt_token_ids),
            sum(len(o.token_ids) for o in final.outputs),
            final.num_cached_tokens,
        )
        return ChatCompletionResponse(
            id=request_id, model=self.response_model(request), choices=choices, usage=usage
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt_tokens: int,
        outputs: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        events = StreamEvents(
            ChatCompletionStreamResponse, request_id, int(time.time()), self.response_model(request)
        )
        chunk = events.chunk
        completion_tokens = cached_tokens = 0
        finished: set[int] = set()
        continuous = request.include_usage and request.stream_options.continuous_usage_stats
        choice_streams = {index: self.choice_stream(request) for index in range(request.n)}
        try:
            for index in range(request.n):
                role = DeltaMessage(role=ROLE, content="")
                yield chunk([ChatCompletionResponseStreamChoice(index=index, delta=role)])
            async for delta in outputs:
                cached_tokens = delta.num_cached_tokens
                for output in delta.outputs:
                    if output.index in finished:
                        continue
                    completion_tokens += len(output.token_ids)
                    wants_logprobs = request.logprobs and output.token_ids
                    # As in completions: new tokens make a chunk even without text (a parsed
                    # choice stream may still hold them back as no piece).
                    if not (output.text or output.token_ids or output.finish_reason):
                        continue
                    if output.finish_reason is not None:
                        finished.add(output.index)
                    usage = None
                    if continuous:
                        usage = UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens)
                    choice_stream = choice_streams[output.index]
                    if choice_stream is None and not request.logprobs:  # the per-token hot path
                        stop_reason = output.stop_reason if output.finish_reason else None
                        choice = content_choice(
                            output.index, output.text, output.finish_reason, stop_reason
                        )
                        yield chunk([choice], usage)
                        continue
                    if choice_stream is None:
                        choice_stream = choice_streams[output.index] = ChoiceStream(None, None)
                    pieces = choice_stream.pieces(output, wants_logprobs)
                    for i, (message, finish_reason) in enumerate(pieces):
                        choice = ChatCompletionResponseStreamChoice(
                            index=output.index,
                            delta=message,
                            logprobs=self._logprobs(request, output) if i == 0 else None,
                            finish_reason=finish_reason,
                            stop_reason=output.stop_reason if finish_reason else None,
                        )
                        yield chunk([choice], usage)
            if request.include_usage:
                yield chunk([], UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens))
        except Exception as exc:
            error = self.engine_failure(exc)
            yield sse_event(error_body(error.message, error.status, error.param))
        yield DONE
