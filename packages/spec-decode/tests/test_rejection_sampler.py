"""Exactness of the rejection sampler, tested statistically.

Each test draws N = 200,000 independent speculative steps at once over a 6-token vocabulary with
3 drafts per step. The target distributions p_1..p_4 are fixed per position (random logits,
then temperature 1, top-k or top-p), so the emitted tokens must follow p_j at position j.
For every position, the counts of emitted tokens are compared with p_j by a
chi-square test over p_j's support (a token outside it fails at once); the test fails when the
p-value is below 1e-6, a false failure once in a million runs per check. Every check sees at
least 5,000 emitted tokens. A sampler told the wrong draft distribution (drafts drawn from a peaked
q, the sampler told they came from the uniform distribution) misses by a total variation of 0.05 to 0.3 and a p-value far below 1e-100: the test can
fail.
"""

import pytest
import torch

from ember_spec_decode import rejection_sample

N = 200_000
VOCAB = 6
K = 3
P_VALUE_FLOOR = 1e-6


def processed(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    probs = logits.softmax(-1)
    if top_k:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = (sorted_probs / sorted_probs.sum(-1, keepdim=True)).cumsum(-1) - sorted_probs
        keep_sorted = mass_before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return 0.0  # a token outside the support was emitted
    expected = probs[support] * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2.0))


def run(p: torch.Tensor, q: torch.Tensor | None, generator, *, told_q: torch.Tensor | None = None):
    """N steps of K drafts: drafts drawn from q (or fixed point masses when q is None); the
    sampler is told ``told_q`` when given, else the truth."""
    if q is None:
        # point masses on likely tokens (as a prompt lookup proposes): the second most likely
        # at the middle position, the most likely elsewhere
        ranked = p[:K].argsort(dim=-1, descending=True)
        drafts = torch.stack([ranked[0, 0], ranked[1, 1], ranked[2, 0]]).expand(N, K)
    else:
        drafts = torch.multinomial(q.expand(N, K, VOCAB).reshape(-1, VOCAB), 1, generator=generator)
        drafts = drafts.view(N, K)
    num_drafts = torch.full((N,), K)
    target = p.expand(N, K + 1, VOCAB).reshape(-1, VOCAB)
    told_q = q if told_q is None else told_q
    draft_probs = None if told_q is None else told_q.expand(N, K, VOCAB).reshape(-1, VOCAB)
    out = rejection_sample(
        target,
        drafts,
        num_drafts,
        torch.rand(N, K, generator=generator, dtype=torch.float64),
        torch.rand(N * (K + 1), generator=generator, dtype=torch.float64),
        draft_probs=draft_probs,
    )
    return out


def position_stats(out, p: torch.Tensor):
    """(p-value, total variation) of the token emitted at each position, over the steps that
    reached it."""
    stats = []
    for j in range(K + 1):
        reached = out.num_tokens > j
        counts = torch.bincount(out.token_ids[reached, j], minlength=VOCAB).double()
        tv = 0.5 * (counts / counts.sum() - p[j]).abs().sum().item()
        stats.append((chi_square_p_value(counts, p[j]), tv, int(reached.sum())))
    return stats


def targets(generator, **processing):
    logits = torch.randn(K + 1, VOCAB, generator=generator, dtype=torch.float64) * 1.5
    return processed(logits, **processing)


@pytest.mark.parametrize(
    "processing", [{}, {"top_k": 3}, {"top_p": 0.7}], ids=["temperature-1", "top-k", "top-p"]
)
@pytest.mark.parametrize("drafts", ["sampled", "point-mass"])
def test_emitted_tokens_follow_the_target(processing, drafts):
    generator = torch.Generator().manual_seed(1234)
    p = targets(generator, **processing)
    q = None
    if drafts == "sampled":
        # a draft that roughly agrees with the target, with mass where the target has none
        noise = torch.softmax(torch.randn(K, VOCAB, generator=generator, dtype=torch.float64), -1)
        q = 0.6 * p[:K] + 0.4 * noise
    out = run(p, q, generator)
    for j, (p_value, tv, reached) in enumerate(position_stats(out, p)):
        assert reached > 5_000, (j, reached)
        assert p_value > P_VALUE_FLOOR, (j, p_value, tv)


def test_a_sampler_told_the_wrong_draft_distribution_is_caught():
    generator = torch.Generator().manual_seed(99)
    p = targets(generator)
    q = torch.softmax(torch.randn(K, VOCAB, generator=generator, dtype=torch.float64) * 2, -1)
    out = run(p, q, generator, told_q=torch.full((K, VOCAB), 1.0 / VOCAB, dtype=torch.float64))
    worst = min(position_stats(out, p)[:K], key=lambda s: s[0])
    assert worst[0] < 1e-100 and worst[1] > 0.03, worst


def test_greedy_accepts_while_the_argmax_agrees():
    # one-hot targets: argmax 1, 0, 4, then 5 at the bonus position
    argmax = torch.tensor([1, 0, 4, 5])
    p = torch.nn.functional.one_hot(argmax, VOCAB).double()
    drafts = torch.tensor([[1, 0, 4], [1, 3, 4], [2, 0, 4], [1, 0, 0]])
    num_drafts = torch.tensor([3, 3, 3, 2])
    rows = [p, p, p, p[[0, 1, 3]]]
    out = rejection_sample(
        torch.cat(rows),
        drafts,
        num_drafts,
        torch.rand(4, K, dtype=torch.float64),
        torch.rand(int(num_drafts.sum()) + 4, dtype=torch.float64),
    )
    assert out.to_lists() == [[1, 0, 4, 5], [1, 0], [1], [1, 0, 5]]
    assert out.num_accepted.tolist() == [3, 1, 0, 2]


def test_rows_without_drafts_draw_one_token():
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    out = rejection_sample(
        p,
        torch.zeros(2, 2, dtype=torch.int64),
        torch.tensor([0, 0]),
        torch.rand(2, 2, dtype=torch.float64),
        torch.tensor([0.3, 0.9], dtype=torch.float64),
    )
    assert out.to_lists() == [[2], [1]]


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(
            torch.ones(3, 4),
            torch.zeros(1, 2, dtype=torch.int64),
            torch.tensor([1]),
            torch.rand(1, 2),
            torch.rand(3),
        )
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(
            torch.ones(4, 4),
            torch.zeros(1, 2, dtype=torch.int64),
            torch.tensor([3]),
            torch.rand(1, 2),
            torch.rand(4),
        )
