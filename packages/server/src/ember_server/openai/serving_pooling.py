"""``POST /v1/embeddings``, ``/classify``, ``/score`` and ``/rerank``: one pooling request per
input, all submitted at once; the response comes when every one has finished."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Coroutine

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ember_scheduler.pooling_params import PoolingParams
from ember_server.engine.input_processor import TokenizedPrompt
from ember_server.engine.pooling_outputs import PoolingRequestOutput
from ember_server.engine.scoring import pair_up, score_mode, scores_from_outputs, scoring_inputs
from ember_server.openai.errors import OpenAIError, from_value_error
from ember_server.openai.protocol import UsageInfo, random_id
from ember_server.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    inputs_of,
)
from ember_server.openai.serving import OpenAIServing
from ember_server.openai.streams import ClientDisconnected, until_disconnect


class OpenAIServingPooling(OpenAIServing):
    """Handlers of the pooling routes."""

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_request(request)
        params = self._params(
            task="embed", dimensions=request.dimensions, normalize=request.normalize
        )
        prompts = [
            await self._prompt(p, request.add_special_tokens) for p in inputs_of(request.input)
        ]
        request_id = random_id("embd")
        outputs = await self._pool(request_id, prompts, params, request.priority, raw_request)
        data = [
            EmbeddingData(
                index=i, embedding=_encode_vector(o.outputs.data, request.encoding_format)
            )
            for i, o in enumerate(outputs)
        ]
        body = EmbeddingResponse(
            id=request_id, model=self.model_name, data=data, usage=_usage(outputs)
        )
        return JSONResponse(body.model_dump())

    async def create_classify(
        self, request: ClassificationRequest, raw_request: Request
    ) -> Response:
        self.check_request(request)
        params = self._params(task="classify")
        prompts = [
            await self._prompt(p, request.add_special_tokens) for p in inputs_of(request.input)
        ]
        request_id = random_id("classify")
        outputs = await self._pool(request_id, prompts, params, request.priority, raw_request)
        labels = self.engine.model_config.labels
        data = []
        for i, output in enumerate(outputs):
            probs = output.outputs.data.tolist()
            label = labels[int(np.argmax(probs))]
            data.append(
                ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs))
            )
        body = ClassificationResponse(
            id=request_id, model=self.model_name, data=data, usage=_usage(outputs)
        )
        return JSONResponse(body.model_dump())

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        self.check_request(request)
        request_id = random_id("score")
        scores, outputs = await self._score(
            request_id, request.text_1, request.text_2, request, raw_request
        )
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        body = ScoreResponse(id=request_id, model=self.model_name, data=data, usage=_usage(outputs))
        return JSONResponse(body.model_dump())

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        self.check_request(request)
        if not request.documents:
            raise OpenAIError("documents must not be empty", 400, "documents")
        request_id = random_id("rerank")
        scores, outputs = await self._score(
            request_id, request.query, request.documents, request, raw_request
        )
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[: request.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=request.documents[i])
                if request.return_documents
                else None,
            )
            for i in order
        ]
        usage = RerankUsage(total_tokens=_usage(outputs).prompt_tokens)
        body = RerankResponse(id=request_id, model=self.model_name, usage=usage, results=results)
        return JSONResponse(body.model_dump(exclude_none=True))

    async def _score(self, request_id, text_1, text_2, request, raw_request):
        """Scores of the text pairs, and the pooling outputs behind them (for usage)."""
        try:
            mode = score_mode(self.engine.model_config)
            pairs = pair_up(text_1, text_2)
            prompts, params = scoring_inputs(mode, self.input_processor.text_encoder, pairs)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        if params.task == "embed":
            prompts = [await self._prompt(p, request.add_special_tokens) for p in prompts]
        outputs = await self._pool(request_id, prompts, params, request.priority, raw_request)
        scored = scores_from_outputs(mode, outputs, [str(i) for i in range(len(pairs))])
        return [s.outputs.score for s in scored], outputs

    async def _prompt(self, prompt: str | list[int], add_special_tokens: bool) -> TokenizedPrompt:
        # A text's errors have always named "prompt", token ids' "input".
        field = "prompt" if isinstance(prompt, str) else "input"
        return await self.prompt(prompt, add_special_tokens, field)

    @staticmethod
    def _params(**fields) -> PoolingParams:
        try:
            return PoolingParams(**fields)
        except ValueError as exc:
            raise from_value_error(exc) from exc

    async def _pool(
        self,
        request_id: str,
        prompts: list[TokenizedPrompt | list[int]],
        params: PoolingParams,
        priority: int,
        raw_request: Request,
    ) -> list[PoolingRequestOutput]:
        """Every prompt pooled, in order; the first failure cancels (and aborts) the rest."""
        calls: list[Coroutine] = [
            self.engine.encode(prompt, params, f"{request_id}-{i}", priority)
            for i, prompt in enumerate(prompts)
        ]
        tasks = [asyncio.ensure_future(call) for call in calls]
        try:
            return await until_disconnect(asyncio.gather(*tasks), raw_request)
        except ClientDisconnected:
            raise OpenAIError("client disconnected", 499) from None
        except Exception as exc:
            raise self.engine_failure(exc) from exc
        finally:
            for task in tasks:
                task.cancel()


def _encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _usage(outputs: list[PoolingRequestOutput]) -> UsageInfo:
    return UsageInfo.of(sum(len(o.prompt_token_ids) for o in outputs), 0)
