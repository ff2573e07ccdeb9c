"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3) vs transformers,
end to end.

Greedy tokens equal transformers' in float32 with whole prompts, with chunked prefill, under
preemption (asserted) and over a warm prefix cache (hits asserted); logprobs within 1e-4. The
tiny checkpoints route each token to 2 of 4 experts (DeepSeek: of 8 in 4 groups, with a shared
expert, a dense first layer and latent attention; V2 with YaRN); Qwen2-MoE's has a gated shared
expert and a dense layer (``mlp_only_layers``), Qwen3-MoE's renormalizes the chosen weights.
"""

from __future__ import annotations

import pytest
import torch
from test_parity import assert_matches_hf, greedy, make_engine, parity_prompts, run
from test_parity_sampling import NUM_LOGPROBS, _check_rows, _hf_log_softmax

from ember_kernels import moe as moe_ops
from ember_scheduler.sampling_params import SamplingParams
from ember_testing.tiny_models import MOE_ARCHITECTURES, tiny_model_path
from ember_worker.layers.parallel import TensorParallelGroup
from ember_worker.model_loader import load_model
from ember_worker.models.mla import MlaAttention
from ember_worker.models.mlp import DecoderMLP
from ember_worker.models.moe import SparseMoeBlock

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_the_loader_builds_expert_layers_where_the_checkpoint_has_them(arch):
    loaded = load_model(tiny_model_path(arch), dtype="float32")
    kinds = [type(layer.mlp) for layer in loaded.model.model.layers]
    if arch == "qwen2_moe":  # mlp_only_layers=[1]
        assert kinds == [SparseMoeBlock, DecoderMLP, SparseMoeBlock]
        assert loaded.model.model.layers[0].mlp.shared_expert is not None
    elif arch.startswith("deepseek"):  # first_k_dense_replace=1, shared experts, MLA
        assert kinds == [DecoderMLP, SparseMoeBlock, SparseMoeBlock]
        assert loaded.model.model.layers[1].mlp.shared_experts is not None
        assert {type(layer.self_attn) for layer in loaded.model.model.layers} == {MlaAttention}
        bias = loaded.model.model.layers[1].mlp.gate.e_score_correction_bias
        assert (bias is not None and bias.abs().sum() > 0) == (arch == "deepseek_v3")
    else:
        assert set(kinds) == {SparseMoeBlock}
    assert loaded.config.moe.top_k == 2


# The default suite runs the richest checkpoints (shared experts, dense layers, latent attention;
# logprobs over softmax and grouped routing); the slow session every architecture.
FULL_PARITY_DEFAULT = ("qwen2_moe", "deepseek_v3")
LOGPROBS_DEFAULT = ("mixtral", "deepseek_v2")


def _suite(archs_in_default):
    return [
        pytest.param(a, marks=() if a in archs_in_default else pytest.mark.slow)
        for a in MOE_ARCHITECTURES
    ]


@pytest.mark.parametrize("arch", _suite(FULL_PARITY_DEFAULT))
def test_greedy_parity_whole_chunked_preempted_and_cached(arch):
    prompts = parity_prompts()
    outputs, totals = run(make_engine(arch), prompts, greedy)
    assert totals["num_preemptions"] == 0
    assert_matches_hf(arch, outputs)
    outputs, _ = run(make_engine(arch, max_num_batched_tokens=24), prompts, greedy)
    assert_matches_hf(arch, outputs)
    outputs, totals = run(make_engine(arch, num_blocks=40), prompts, greedy)
    assert totals["num_preemptions"] > 0
    assert_matches_hf(arch, outputs)
    core = make_engine(arch, prefix_caching=True)
    run(core, prompts, greedy, prefix="first-")
    outputs, totals = run(core, prompts, greedy, prefix="second-")
    assert totals["prefix_cache_hits"] > 0
    assert_matches_hf(arch, outputs)


@pytest.mark.parametrize("arch", _suite(LOGPROBS_DEFAULT))
def test_logprobs_match_transformers(arch):
    prompts = [parity_prompts()[i] for i in (15, 3, 11)]  # 110, ~60 and 5 tokens
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=NUM_LOGPROBS,
        prompt_logprobs=NUM_LOGPROBS,
    )  # fmt: skip
    outputs, _ = run(make_engine(arch, max_num_batched_tokens=24), prompts, lambda _i: params)
    for i, prompt in enumerate(prompts):
        generated = outputs[i]["tokens"]
        assert len(generated) == 12
        reference = _hf_log_softmax(arch, prompt + generated)
        _check_rows(outputs[i]["prompt_logprobs"], reference[: len(prompt) - 1], prompt[1:])
        _check_rows(outputs[i]["logprobs"], reference[len(prompt) - 1 : -1], generated)


def test_sliding_window_moe_checkpoints_are_refused():
    from ember_worker.hf_config import hf_config_from_dict
    from ember_worker.models import DecoderConfig

    raw = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window"):
        DecoderConfig.from_hf_config(hf_config_from_dict(raw))


def _rank_model(path, rank: int, expert_parallel: bool, placement: str = "linear"):
    """Rank ``rank`` of 2's shards. Loading copies slices and runs no collective, so the group
    object is never used here (the distributed suite runs the real two-rank groups)."""
    tp = TensorParallelGroup(rank, 2, group=object())
    return load_model(
        path, dtype="float32", tp=tp, expert_parallel=expert_parallel,
        expert_placement_strategy=placement,
    ).model  # fmt: skip


@pytest.mark.parametrize(
    ("expert_parallel", "placement"),
    [(False, "linear"), (True, "linear"), (True, "round_robin")],
    ids=["tp", "ep", "ep-round-robin"],
)
def test_two_ranks_experts_sum_to_the_whole_layer(expert_parallel, placement):
    """Each rank's expert shards (a slice of every expert, or two whole experts) add up, as the
    all-reduce (or the all-to-all combine) adds them, to the one-rank layer's experts."""
    path = tiny_model_path("qwen2_moe")
    whole = load_model(path, dtype="float32").model.model.layers[0].mlp
    ranks = [_rank_model(path, r, expert_parallel, placement).model.layers[0].mlp for r in (0, 1)]
    x = torch.randn(9, whole.experts.w13_weight.shape[2])
    weights, ids = moe_ops.select_experts(whole.gate(x), 2)
    if expert_parallel:
        held = [[0, 1], [2, 3]] if placement == "linear" else [[0, 2], [1, 3]]
        assert [r.experts.local_experts for r in ranks] == held
        torch.testing.assert_close(ranks[1].experts.w13_weight, whole.experts.w13_weight[held[1]])
        placement = ranks[0].experts.dispatcher.placement
        total = sum(
            moe_ops.fused_experts(
                x, r.experts.w13_weight, r.experts.w2_weight, weights, ids,
                expert_map=placement.expert_map(rank),
            )
            for rank, r in enumerate(ranks)
        )  # fmt: skip
        shared = ranks[0].shared_expert.gate_up_proj.weight
        assert shared.shape == whole.shared_expert.gate_up_proj.weight.shape  # replicated
    else:
        assert ranks[0].experts.w2_weight.shape[2] * 2 == whole.experts.w2_weight.shape[2]
        total = sum(r.experts(x, weights, ids) for r in ranks)
    torch.testing.assert_close(total, whole.experts(x, weights, ids), rtol=1e-5, atol=1e-6)


def test_expert_parallel_needs_experts_and_a_known_placement():
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        load_model(tiny_model_path("llama"), dtype="float32", expert_parallel=True)
    with pytest.raises(ValueError, match="expert_placement_strategy"):
        load_model(
            tiny_model_path("mixtral"), dtype="float32", expert_parallel=True,
            expert_placement_strategy="random",
        )  # fmt: skip
    # The settings' torch-free list names the kernel's placements.
    from ember_worker.expert_placement import EXPERT_PLACEMENT_STRATEGIES

    assert EXPERT_PLACEMENT_STRATEGIES == moe_ops.PLACEMENT_STRATEGIES


@pytest.mark.parametrize("arch", _suite(("deepseek_v2",)))
def test_ngram_speculative_decoding_greedy_parity(arch):
    """Drafts verified in one step over the expert layers (and the latent cache): accepted
    drafts, preemption, chunked prefill and a warm prefix cache, tokens unchanged."""
    from test_spec_decode import COMBINED, NGRAM, assert_greedy_parity

    assert_greedy_parity(arch, NGRAM, COMBINED)
