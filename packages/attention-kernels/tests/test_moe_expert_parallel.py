"""Expert parallelism: placements, and all-to-all dispatch/combine over three gloo ranks against
the single-rank fused experts (float64), with uneven token counts, a rank that brings no tokens
and a rank that receives none; and the token slices of replicated inputs gathered back."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ember_kernels import moe
from ember_kernels.moe import ExpertPlacement, token_slice

NUM_EXPERTS, HIDDEN, INTER, TOP_K, RANKS = 7, 16, 8, 2, 3
TOKENS_PER_RANK = (5, 0, 3)


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
@pytest.mark.parametrize("num_experts,size", [(8, 2), (7, 3), (3, 3), (10, 4)])
def test_placement_is_balanced_and_covers_every_expert_once(strategy, num_experts, size):
    placement = ExpertPlacement(num_experts, size, strategy)
    shares = [placement.local_experts(r) for r in range(size)]
    assert sorted(e for share in shares for e in share) == list(range(num_experts))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    owners, local = placement.owners(), placement.local_indices()
    for rank, share in enumerate(shares):
        assert owners[share].tolist() == [rank] * len(share)
        assert local[share].tolist() == list(range(len(share)))
        expert_map = placement.expert_map(rank)
        assert expert_map[share].tolist() == list(range(len(share)))
        assert int((expert_map >= 0).sum()) == len(share)


def test_placement_refuses_bad_arguments():
    with pytest.raises(ValueError, match="strategy"):
        ExpertPlacement(8, 2, "random")
    with pytest.raises(ValueError, match="num_experts"):
        ExpertPlacement(2, 4)
    with pytest.raises(ValueError, match="rank"):
        ExpertPlacement(8, 2).local_experts(2)


def _inputs():
    """Every rank's tokens together, the experts' weights, and the generator for the routing."""
    gen = torch.Generator().manual_seed(0)
    total = sum(TOKENS_PER_RANK)
    x = torch.randn(total, HIDDEN, generator=gen, dtype=torch.float64)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen, dtype=torch.float64)
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen, dtype=torch.float64)
    return x, w13, w2, gen


def _routing(gen, total, allowed):
    """Each token's ``TOP_K`` distinct experts among ``allowed``, and their weights."""
    picks = [torch.randperm(len(allowed), generator=gen)[:TOP_K] for _ in range(total)]
    ids = torch.tensor(allowed)[torch.stack(picks)]
    return torch.rand(total, TOP_K, generator=gen), ids


SCENARIOS = (("linear", None), ("round_robin", None), ("linear", 1))  # (strategy, starved rank)


def _allowed(placement, starved):
    """The experts the tokens may pick: with a ``starved`` rank, none of its experts."""
    banned = () if starved is None else placement.local_experts(starved)
    return [e for e in range(NUM_EXPERTS) if e not in banned]


def _rank_main(rank, port, queue):
    """One rank: every scenario's dispatch/combine, then the gathered token slices."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=RANKS)  # fmt: skip
    try:
        answers = []
        start = sum(TOKENS_PER_RANK[:rank])
        mine = slice(start, start + TOKENS_PER_RANK[rank])
        for strategy, starved in SCENARIOS:
            placement = ExpertPlacement(NUM_EXPERTS, RANKS, strategy)
            x, w13, w2, gen = _inputs()
            weights, ids = _routing(gen, x.shape[0], _allowed(placement, starved))
            held = placement.local_experts(rank)
            dispatcher = moe.AllToAllDispatcher(placement, rank, dist.group.WORLD)
            received = dispatcher.dispatch(x[mine], ids[mine]).rows.shape[0]
            out = moe.expert_parallel_experts(
                x[mine], w13[held], w2[held], weights[mine], ids[mine], dispatcher
            )
            answers.append((out.numpy(), int(received)))
        # Replicated tokens (tensor-parallel attention): each rank its slice, all gathered.
        few = _inputs()[0][:2]  # fewer tokens than ranks: one slice is empty
        part = few[token_slice(2, rank, RANKS)] * (rank + 1)
        gathered = moe.gather_token_slices(part, 2, RANKS, dist.group.WORLD)
        # numpy arrays travel by value (a shared tensor would die with this process).
        queue.put((rank, answers, gathered.numpy()))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_answers():
    """Each rank's answers from one run of three gloo ranks."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, queue)) for r in range(RANKS)]
    for p in procs:
        p.start()
    got = {
        rank: ([(torch.from_numpy(out), n) for out, n in answers], torch.from_numpy(gathered))
        for rank, answers, gathered in (queue.get(timeout=180) for _ in procs)
    }
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


@pytest.mark.parametrize("scenario", range(len(SCENARIOS)))
def test_dispatch_combine_equals_single_rank_fused_experts(rank_answers, scenario):
    strategy, starved = SCENARIOS[scenario]
    placement = ExpertPlacement(NUM_EXPERTS, RANKS, strategy)
    x, w13, w2, gen = _inputs()
    weights, ids = _routing(gen, x.shape[0], _allowed(placement, starved))
    expected = moe.fused_experts(x, w13, w2, weights, ids)
    outs = [rank_answers[r][0][scenario][0] for r in range(RANKS)]
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-12, atol=1e-12)
    assert outs[1].shape == (0, HIDDEN)  # the rank that brought no tokens
    received = [rank_answers[r][0][scenario][1] for r in range(RANKS)]
    assert sum(received) == x.shape[0] * TOP_K
    if starved is not None:
        assert received[starved] == 0


def test_token_slices_gathered_in_order_on_every_rank(rank_answers):
    few = _inputs()[0][:2]
    want = torch.cat([few[token_slice(2, s, RANKS)] * (s + 1) for s in range(RANKS)])
    for r in range(RANKS):
        torch.testing.assert_close(rank_answers[r][1], want)
