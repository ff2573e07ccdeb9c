"""What every OpenAI route shares: model check, prompts through the engine's input processor (the
one owner of tokenization and the request rules), the output budget, generation."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import anyio

from ember_scheduler.lora import LoRARequest
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.admission import EngineOverloadedError, RequestTimeoutError
from ember_server.engine.core_client import EngineDeadError
from ember_server.engine.input_processor import TokenizedPrompt
from ember_server.engine.outputs import RequestOutput
from ember_server.openai.errors import OpenAIError, from_value_error
from ember_server.openai.protocol import OpenAIRequest
from ember_server.openai.protocol_chat import ChatCompletionRequest
from ember_server.openai.protocol_tokenize import TokenizeChatRequest
from ember_server.openai.streams import StartedStream

logger = logging.getLogger(__name__)
# How the input processor's structured-output errors begin (they name SamplingParams' field).
STRUCTURED_OUTPUTS = "SamplingParams.structured_outputs"


class OpenAIServing:
    """Base of the route handlers, bound to one running engine (``AsyncLLM``)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.input_processor = engine.input_processor
        self.model_name: str = engine.served_model_name
        self.max_model_len: int = engine.model_config.max_model_len

    def check_request(self, request: OpenAIRequest, adapters: bool = False) -> LoRARequest | None:
        """404 for another model's name, 503 when the engine is down; log ignored fields.
        With ``adapters`` (the generation routes) a served LoRA adapter's name is a model too:
        returns its ``LoRARequest`` (None: the base model)."""
        model = getattr(request, "model", None)
        lora = None
        if model is not None and model != self.model_name:
            lora = self.input_processor.loras.named(model) if adapters else None
            if lora is None:
                raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")
        self.check_engine()
        if request.ignored_fields:
            logger.warning("ignoring unknown request fields: %s", ", ".join(request.ignored_fields))
        return lora

    def response_model(self, request: OpenAIRequest) -> str:
        """The ``model`` a response names: the request's (the base model or a served adapter,
        as ``check_request`` accepted), else the base model's served name."""
        return getattr(request, "model", None) or self.model_name

    def check_engine(self) -> None:
        if self.engine.errored:
            raise OpenAIError(f"The engine is not running: {self.engine.dead_error}", 503)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of text (``/tokenize``: no request follows, so no request rules), in a worker
        thread (the tokenizer releases the GIL there), after a length check that refuses a huge
        text without tokenizing it."""
        encoder = self.input_processor.text_encoder
        return await self._in_thread("prompt", encoder.encode, text, add_special_tokens)

    async def prompt(
        self, prompt: str | list[int], add_special_tokens: bool, field: str
    ) -> TokenizedPrompt:
        """A request's prompt, text (tokenized in a worker thread) or token ids, checked by the
        input processor; its errors are 400s naming ``field``."""
        if isinstance(prompt, str):
            tokenize = self.input_processor.tokenize_text
            return await self._in_thread(field, tokenize, prompt, add_special_tokens, field)
        try:
            return self.input_processor.tokenize_ids(prompt, field)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, field) from exc

    async def chat_prompt(self, request: ChatCompletionRequest) -> TokenizedPrompt:
        """The request's messages through the chat template, as a prompt."""
        return await self._chat(self.input_processor.tokenize_chat, request)

    async def encode_chat(self, request: TokenizeChatRequest) -> list[int]:
        """Token ids of the request's messages through the chat template (``/tokenize``)."""
        _, token_ids = await self._chat(self.input_processor.text_encoder.encode_chat, request)
        return token_ids

    async def _chat(self, tokenize, request: ChatCompletionRequest | TokenizeChatRequest):
        """``tokenize`` (the input processor's, or its encoder's) of the request's messages in a
        worker thread; message text stays plain text (see ``TextEncoder.encode_chat``)."""
        try:
            return await asyncio.to_thread(
                tokenize,
                request.conversation(),
                tools=request.template_tools()
                if isinstance(request, ChatCompletionRequest)
                else None,
                client_kwargs=request.chat_template_kwargs,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
            )
        except ValueError as exc:  # too long, or forged special tokens the template rewrites
            raise OpenAIError(str(exc), 400, "messages") from exc
        except Exception as exc:  # jinja errors, a template that rejects the conversation
            raise OpenAIError(f"Cannot apply the chat template: {exc}", 400, "messages") from exc

    @staticmethod
    async def _in_thread(field: str, fn, *args):
        """``fn(*args)`` in a worker thread (the tokenizer releases the GIL there; the encoder
        refuses a huge text before tokenizing it); ValueErrors are 400s naming ``field``."""
        try:
            return await asyncio.to_thread(fn, *args)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, field) from exc

    def check_token_ids(self, token_ids: list[int], field: str) -> None:
        try:
            self.input_processor.check_token_ids(token_ids, field)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, field) from exc

    def max_tokens_for(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        """The output budget; 400 when the prompt, or prompt plus ``requested``, exceeds the room
        the engine's input processor (the owner of the length limit) leaves.

        Without ``requested``, ``default`` (or else all the room left) is used, capped by the room.
        """
        try:
            room = self.engine.input_processor.output_room(prompt_len)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400, "prompt") from exc
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise OpenAIError(
                f"This model's maximum context length is {prompt_len + room} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} in the completion). Please reduce the length of the prompt or "
                "max_tokens.",
                400,
                "max_tokens",
            )
        return requested

    @staticmethod
    def sampling_params(build, max_tokens: int) -> SamplingParams:
        """Build SamplingParams, turning its range errors into 400s naming the field."""
        try:
            return build(max_tokens)
        except ValueError as exc:
            raise from_value_error(exc) from exc

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def generate(
        self,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        request_id: str,
        priority: int,
        stream: bool,
        structured_field: str | None = None,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one prompt; the engine checks it now, so bad input is a 400 before any output,
        and it is sent at once (see ``StartedStream``). A structured-output spec that does not
        parse is a 400 naming ``structured_field``, the request field it came from. ``timeout``
        (seconds, the body's) bounds the request's time; a full waiting queue is a 503."""
        try:
            outputs = self.engine.generate(
                prompt,
                params,
                request_id,
                priority=priority,
                stream=stream,
                timeout=timeout,
                lora_request=lora_request,
            )
        except ValueError as exc:
            if structured_field is not None and str(exc).startswith(STRUCTURED_OUTPUTS):
                raise OpenAIError(f"{structured_field}: {exc}", 400, structured_field) from exc
            raise from_value_error(exc) from exc
        except EngineDeadError as exc:  # it died (or the server began to stop) since the check
            raise OpenAIError(f"The engine is not running: {exc}", 503) from exc
        except EngineOverloadedError as exc:
            raise overloaded(exc) from exc
        return StartedStream(self._abort_unless_finished(outputs, request_id))

    async def _abort_unless_finished(
        self, outputs: AsyncIterator[RequestOutput], request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Pass outputs through; abort the request if iteration stops before it finished.

        That happens on client disconnect (the stream is cancelled or closed) and on errors. The
        abort is shielded: Starlette cancels a dropped stream's whole scope.
        """
        finished = False
        try:
            async for output in outputs:
                finished = output.finished
                yield output
        finally:
            with anyio.CancelScope(shield=True):
                if not finished and not self.engine.errored:
                    await self.engine.abort(request_id)
                # Close the engine's stream now (it drops its queue), not when it is collected:
                # a stream cancelled while it holds undelivered outputs would keep them till then.
                await outputs.aclose()

    def engine_failure(self, exc: BaseException) -> OpenAIError:
        """The error to report when generation failed for a reason other than bad input."""
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, ValueError):  # the engine core refused the request (bad input)
            return from_value_error(exc)
        if isinstance(exc, RequestTimeoutError):
            return OpenAIError(str(exc), 408, "timeout")
        if isinstance(exc, EngineOverloadedError):
            return overloaded(exc)
        if isinstance(exc, EngineDeadError) or self.engine.errored:
            return OpenAIError(f"The request could not finish: {exc}", 503)
        logger.exception("generation failed", exc_info=exc)
        return OpenAIError(f"internal server error: {type(exc).__name__}: {exc}", 500)


def overloaded(exc: EngineOverloadedError) -> OpenAIError:
    """A full waiting queue: 503 with the time to retry after."""
    return OpenAIError(str(exc), 503, headers={"Retry-After": str(exc.retry_after)})
