"""Pooling requests vs Hugging Face transformers: embeddings, classification and scores.

Embeddings (last, mean and cls pooling, normalized or not, truncated to ``dimensions``) must
match the pooled final hidden states of transformers' ``AutoModel`` within 1e-4, for every
architecture, for single prompts and for batches of unequal lengths whose long prompts are
chunked by a small token budget, and again when the prompts come back and hit the prefix cache.
Classification probabilities must match ``AutoModelForSequenceClassification``'s softmax, with
batches of unequal lengths (the engine packs them without padding; transformers pads). Generation
running beside pooling requests in one engine must produce the same greedy tokens as alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from ember_scheduler import (
    EngineCore,
    EngineCoreRequest,
    PoolingParams,
    SamplingParams,
    SchedulerConfig,
)
from ember_server.engine.llm import LLM
from ember_testing.tiny_models import (
    ARCHITECTURES,
    CLASSIFIER_ARCHITECTURES,
    tiny_classifier_path,
    tiny_model_path,
)
from ember_worker.executor import InProcessExecutor

TOLERANCE = 1e-4
TOKEN_BUDGET = 64  # prompts longer than this are chunked
PROMPTS = [
    "def main():\n    return 0",
    "The quick brown fox jumps over the lazy dog. " * 15,  # ~150 tokens: three chunks
    "x",
    "import json\nprint(json.dumps({'a': 1}))",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llm(path, **kwargs) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        max_num_batched_tokens=TOKEN_BUDGET,
        max_model_len=512,
        **kwargs,
    )


def _hf_hidden_states(path, prompts) -> list[torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [
            model(tokenizer(p, return_tensors="pt").input_ids).last_hidden_state[0] for p in prompts
        ]


def _reference(hidden: torch.Tensor, pooling_type: str, normalize: bool, dimensions=None):
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling_type]
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.numpy()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def embedding_setup(request):
    path = tiny_model_path(request.param)
    llm = _llm(path, runner="pooling")
    yield llm, _hf_hidden_states(path, PROMPTS)
    llm.shutdown()


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_match_transformers(embedding_setup, pooling_type, normalize):
    llm, hidden = embedding_setup
    params = PoolingParams(pooling_type=pooling_type, normalize=normalize)
    batched = llm.embed(PROMPTS, params, use_tqdm=False)
    single = llm.embed(PROMPTS[1], params, use_tqdm=False)  # alone, and from the prefix cache
    for output, states in zip(batched, hidden):
        expected = _reference(states, pooling_type, normalize)
        np.testing.assert_allclose(output.outputs.embedding, expected, atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(
        single[0].outputs.embedding, batched[1].outputs.embedding, atol=TOLERANCE, rtol=0
    )


def test_embeddings_use_the_prefix_cache_only_for_last_pooling(tiny_model):
    llm = _llm(tiny_model("llama"), runner="pooling")
    prompt = PROMPTS[1]
    hidden = _hf_hidden_states(tiny_model("llama"), [prompt])[0]
    for pooling_type in ("last", "mean", "cls"):
        params = PoolingParams(pooling_type=pooling_type)
        first, again = llm.encode([prompt, prompt], params, use_tqdm=False)
        cached = max(first.num_cached_tokens, again.num_cached_tokens)
        assert (cached > 0) == (pooling_type == "last")
        for output in (first, again):
            expected = _reference(hidden, pooling_type, True)
            np.testing.assert_allclose(output.outputs.data, expected, atol=TOLERANCE, rtol=0)
    llm.shutdown()


def test_dimensions_truncate_then_normalize(tiny_model):
    path = tiny_model("qwen3")
    llm = _llm(path, runner="pooling", pooling_type="mean")
    hidden = _hf_hidden_states(path, PROMPTS[:2])
    outputs = llm.embed(PROMPTS[:2], PoolingParams(dimensions=16), use_tqdm=False)
    for output, states in zip(outputs, hidden):
        assert output.outputs.hidden_size == 16
        expected = _reference(states, "mean", True, dimensions=16)
        np.testing.assert_allclose(output.outputs.embedding, expected, atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="dimensions must be at most"):
        llm.embed("x", PoolingParams(dimensions=10_000), use_tqdm=False)
    with pytest.raises(ValueError, match="cannot classify"):
        llm.classify("x", use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.generate("x", use_tqdm=False)
    llm.shutdown()


@pytest.mark.parametrize("arch", CLASSIFIER_ARCHITECTURES)
def test_classification_matches_transformers(arch):
    path = tiny_classifier_path(arch, num_labels=3)
    llm = _llm(path)  # runner "auto" picks pooling for a classifier
    assert llm.model_config.runner == "pooling"
    outputs = llm.classify(PROMPTS, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # transformers batches the prompts padded; the engine packs them
        batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
        expected = model(**batch).logits.softmax(-1).numpy()
    for output, probs in zip(outputs, expected):
        assert output.outputs.num_classes == 3
        np.testing.assert_allclose(output.outputs.probs, probs, atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="one label"):
        llm.score("a", "b", use_tqdm=False)
    llm.shutdown()


def test_cross_encoder_score_matches_transformers(tiny_model):
    path = tiny_classifier_path("qwen2", num_labels=1)
    llm = _llm(path)
    query, documents = "what is json", ["import json", "the lazy dog", "x"]
    scores = llm.score(query, documents, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for score, document in zip(scores, documents):
            ids = tokenizer(query, document, return_tensors="pt").input_ids
            expected = model(ids).logits[0, 0].sigmoid().item()
            assert abs(score.outputs.score - expected) < TOLERANCE
    llm.shutdown()


def test_embedding_score_is_cosine_similarity(tiny_model):
    path = tiny_model("mistral")
    llm = _llm(path, runner="pooling")
    hidden = _hf_hidden_states(path, PROMPTS[:3])
    scores = llm.score(PROMPTS[0], PROMPTS[1:3], use_tqdm=False)
    for score, other in zip(scores, hidden[1:3]):
        a, b = hidden[0][-1], other[-1]
        expected = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        assert abs(score.outputs.score - expected) < TOLERANCE
    with pytest.raises(ValueError, match="as many as text_2"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    llm.shutdown()


def test_generation_is_unchanged_by_pooling_alongside(tiny_model):
    """One engine (a generate runner) serving both: pooling requests share steps with greedy
    generation and change none of its tokens; their embeddings still match transformers."""
    path = tiny_model("qwen2")
    llm = _llm(path)
    assert llm.model_config.can_generate
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt_ids = [llm.input_processor.tokenize(p)[1] for p in PROMPTS]
    alone = llm.generate(PROMPTS, greedy, use_tqdm=False)

    core = llm.engine_core
    for i, ids in enumerate(prompt_ids):
        core.add_request(EngineCoreRequest(f"gen-{i}", ids, greedy))
        pooling = llm.input_processor.make_pooling_request(f"pool-{i}", ids, PoolingParams())
        core.add_request(pooling)
    tokens: dict[str, list[int]] = {}
    pooled: dict[str, bytes] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.pooling_output is not None:
                pooled[out.request_id] = out.pooling_output
    for i, output in enumerate(alone):
        assert tokens[f"gen-{i}"] == output.outputs[0].token_ids
        assert tokens[f"pool-{i}"] == []
    hidden = _hf_hidden_states(path, PROMPTS)
    for i, states in enumerate(hidden):
        vector = np.frombuffer(pooled[f"pool-{i}"], dtype="<f4")
        np.testing.assert_allclose(vector, _reference(states, "last", True), atol=TOLERANCE)
    embedded = llm.embed(PROMPTS[0], use_tqdm=False)  # the offline API on a generate runner
    np.testing.assert_allclose(
        embedded[0].outputs.embedding, _reference(hidden[0], "last", True), atol=TOLERANCE
    )
    llm.shutdown()


@pytest.mark.parametrize(
    "pooling_type",
    [
        "mean",
        pytest.param("cls", marks=pytest.mark.slow),
        pytest.param("last", marks=pytest.mark.slow),
    ],
)
def test_pooling_survives_preemption(tiny_model, pooling_type):
    """Six prompts prefilled side by side in chunks of 32 tokens, with a KV pool too small for
    them all: requests mid-prompt are preempted and redone (their partial pools start over), and
    every result still matches transformers."""
    path = tiny_model("llama")
    block_size = 16
    executor = InProcessExecutor(
        path,
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=192,
        block_size=block_size,
        # 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 512 bytes per token.
        kv_cache_memory=24 * block_size * 512,
    )
    assert executor.num_kv_blocks == 24
    config = SchedulerConfig(
        max_num_batched_tokens=192, max_model_len=512, long_prefill_token_threshold=32
    )
    core = EngineCore(executor, config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [f"{i} " + PROMPTS[1] for i in range(6)]  # ~150 tokens each, no shared prefix
    params = PoolingParams(pooling_type=pooling_type)
    for i, prompt in enumerate(prompts):
        ids = tokenizer(prompt).input_ids
        core.add_request(EngineCoreRequest(str(i), ids, SamplingParams(), pooling_params=params))
    pooled, preemptions = {}, 0
    while core.has_unfinished_requests():
        outputs = core.step()
        preemptions += outputs.scheduler_stats.num_preemptions
        pooled.update({o.request_id: o.pooling_output for o in outputs.outputs})
    assert preemptions > 0
    for i, hidden in enumerate(_hf_hidden_states(path, prompts)):
        vector = np.frombuffer(pooled[str(i)], dtype="<f4")
        expected = _reference(hidden, pooling_type, True)
        np.testing.assert_allclose(vector, expected, atol=TOLERANCE, rtol=0)
