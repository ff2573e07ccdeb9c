"""Beam search over HTTP (vLLM's ``use_beam_search`` on ``/v1/completions``): the loop of
``engine/beam_search.py`` over the engine's ordinary one-token requests, one per live beam and
step; the ``n`` best beams of each prompt are its choices."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember_server.engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    eos_token_ids,
    finished_sequences,
)
from ember_server.openai.errors import OpenAIError
from ember_server.openai.protocol import UsageInfo
from ember_server.openai.protocol_completion import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from ember_server.openai.streams import ClientDisconnected, until_disconnect


async def _search(
    serving, prompt, params: BeamSearchParams, request: CompletionRequest, request_id: str
) -> BeamSearchOutput:
    search = BeamSearch(prompt.token_ids, params, eos_token_ids(serving.engine.model_config))
    step = params.step_params()
    number = 0
    while not search.done:
        streams = []
        for beam in search.live:
            tokens = serving.input_processor.tokenize_ids(beam.tokens, "prompt")
            streams.append(
                serving.generate(tokens, step, f"{request_id}-{number}", request.priority, False)
            )
            number += 1
        finals = await asyncio.gather(*(serving.last_output(s) for s in streams))
        search.advance([final.outputs[0].logprobs[0] for final in finals])
    return finished_sequences(search, serving.tokenizer)


async def beam_search_completion(
    serving, request: CompletionRequest, prompts: list, request_id: str, raw_request: Request
) -> Response:
    """The completion answer of a ``use_beam_search`` request (``n`` is the beam width)."""
    try:
        params = [
            BeamSearchParams(
                beam_width=request.n,
                max_tokens=p.params.max_tokens,
                ignore_eos=request.ignore_eos,
                length_penalty=request.length_penalty,
            )
            for p in prompts
        ]
    except ValueError as exc:
        raise OpenAIError(str(exc).replace("BeamSearchParams.beam_width", "n"), 400, "n") from exc
    searches = [
        _search(serving, p.prompt, param, request, f"{request_id}-{i}")
        for i, (p, param) in enumerate(zip(prompts, params))
    ]
    try:
        outputs = await until_disconnect(asyncio.gather(*searches), raw_request)
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as exc:
        raise serving.engine_failure(exc) from exc
    choices, completion_tokens = [], 0
    for prompt_index, (prompt, output) in enumerate(zip(prompts, outputs)):
        for i, sequence in enumerate(output.sequences):
            generated = len(sequence.tokens) - len(prompt.token_ids)
            completion_tokens += generated
            choices.append(
                CompletionResponseChoice(
                    index=prompt_index * request.n + i,
                    text=sequence.text,
                    finish_reason="stop" if sequence.finished else "length",
                )
            )
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    usage = UsageInfo.of(prompt_tokens, completion_tokens)
    body = CompletionResponse(id=request_id, model=serving.model_name, choices=choices, usage=usage)
    return JSONResponse(body.model_dump())
