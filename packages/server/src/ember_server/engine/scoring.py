"""Scoring text pairs (``LLM.score``, ``/score``, ``/rerank``) with a pooling model.

A sequence classifier with one label is a cross-encoder: each pair is tokenized as one input
(the tokenizer's text pair) and its sigmoid probability is the score. An embedding model (no
score head) embeds both texts and the score is their cosine similarity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ember_scheduler.pooling_params import PoolingParams
from ember_server.engine.model_config import ModelConfig
from ember_server.engine.pooling_outputs import (
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ember_server.engine.text_encoding import TextEncoder

CROSS_ENCODER, EMBEDDING = "cross-encoder", "embedding"


def score_mode(model_config: ModelConfig) -> str:
    """How this model scores pairs; ValueError for a classifier of several labels."""
    if model_config.num_labels is None:
        return EMBEDDING
    if model_config.num_labels == 1:
        return CROSS_ENCODER
    raise ValueError(
        f"scoring needs a classifier of one label (a cross-encoder) or an embedding model; this "
        f"model classifies into {model_config.num_labels} labels"
    )


def pair_up(text_1, text_2) -> list[tuple[str, str]]:
    """Pairs of texts: one to one, one to many, or two lists of the same length."""
    firsts, seconds = _as_texts(text_1, "text_1"), _as_texts(text_2, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"text_1 must hold one text or as many as text_2 ({len(seconds)}), got {len(firsts)}"
        )
    return list(zip(firsts, seconds))


def scoring_inputs(mode: str, text_encoder: TextEncoder, pairs: list[tuple[str, str]]):
    """The prompts and pooling parameters that score ``pairs``: one prompt per pair for a
    cross-encoder (token ids of the text pair), the two texts of each pair for embeddings."""
    if mode == CROSS_ENCODER:
        prompts = [text_encoder.encode_pair(a, b) for a, b in pairs]
        return prompts, PoolingParams(task="classify")
    return [text for pair in pairs for text in pair], PoolingParams(task="embed", normalize=True)


def scores_from_outputs(
    mode: str, outputs: list[PoolingRequestOutput], request_ids: list[str]
) -> list[ScoringRequestOutput]:
    """One ``ScoringRequestOutput`` per pair from the pooled outputs of ``scoring_inputs``."""
    if mode == CROSS_ENCODER:
        return [
            ScoringRequestOutput(
                rid, ScoringOutput(float(out.outputs.data[0])), out.prompt_token_ids
            )
            for rid, out in zip(request_ids, outputs)
        ]
    results = []
    for rid, first, second in zip(request_ids, outputs[0::2], outputs[1::2]):
        a, b = first.outputs.data, second.outputs.data
        cosine = float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
        tokens = [*first.prompt_token_ids, *second.prompt_token_ids]
        results.append(ScoringRequestOutput(rid, ScoringOutput(cosine), tokens))
    return results


def score_pairs(
    model_config: ModelConfig,
    text_encoder: TextEncoder,
    text_1,
    text_2,
    encode: Callable[[list, PoolingParams], list[PoolingRequestOutput]],
) -> list[ScoringRequestOutput]:
    """Score every pair with ``encode`` (the offline engine's)."""
    mode = score_mode(model_config)
    pairs = pair_up(text_1, text_2)
    prompts, params = scoring_inputs(mode, text_encoder, pairs)
    outputs = encode(prompts, params)
    return scores_from_outputs(mode, outputs, [str(i) for i in range(len(pairs))])


def _as_texts(value, name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if (
        not isinstance(texts, Sequence)
        or not texts
        or not all(isinstance(t, str) and t for t in texts)
    ):
        raise ValueError(f"{name} must be a non-empty string or a non-empty list of them")
    return list(texts)
