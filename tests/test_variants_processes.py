"""Variant statistics of the whole batch: the same advantages on one process as split over two.

Each "process" is a thread holding an accelerator stand-in whose ``gather`` / ``reduce`` / ``pad_across_processes``
exchange tensors through a barrier, as accelerate's collectives do over gloo: the transform stage runs on each
process's own rows, and whatever a variant takes over "the batch" (an entropy, a success rate, a ranking, a noise
spread) must come out as the one-process figure. Groups are whole on one process (the contiguous split of a real
run). Measured before the change (2 processes against 1): STARE's gate 0.193 / 0.559 per process against 0.376,
G2RPO shaping damped 12 tokens against 0, A-GRAE's accuracy progress 0.75 / 0.25 against 0.5, VIG's kept samples
[1,0,1,0,1,0,0,1] against [0,0,0,0,1,1,1,1], adaptive noise levels 0.048 apart between the replicas.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms.a_grae import AGRAE, AGRAEOptions
from mmrl.algorithms.adaptive_noise import AdaptiveNoise, AdaptiveNoiseOptions
from mmrl.algorithms.base import Intermediate, TransformContext, global_mean, global_pool
from mmrl.algorithms.g2rpo_shaping import G2RPOShaping, G2RPOShapingOptions
from mmrl.algorithms.stare import STARE, STAREOptions
from mmrl.algorithms.vig import VIG, VIGOptions
from mmrl.trainer import mean_over_processes

N, T, G = 8, 6, 4  # one global batch: 2 groups x 4 samples, 6 tokens each


class Exchange:
    """The rendezvous of ``processes`` threads: each deposits a value and receives every process's, in rank order."""

    def __init__(self, processes: int):
        self.slots = [None] * processes
        self.barrier = threading.Barrier(processes, timeout=30)

    def __call__(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        return everyone


class ThreadAccelerator:
    """accelerate's collectives for one thread-process: ``gather`` concatenates along dim 0 (a 0-d tensor as one
    row), ``reduce`` sums or averages, ``pad_across_processes`` pads dim 0 to the longest with zeros."""

    device = "cpu"

    def __init__(self, exchange: Exchange, rank: int):
        self.exchange, self.process_index, self.num_processes = exchange, rank, len(exchange.slots)

    def gather(self, tensor):
        return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in self.exchange(self.process_index, tensor)])

    def reduce(self, tensor, reduction="sum"):
        total = torch.stack(self.exchange(self.process_index, tensor)).sum(0)
        return total / self.num_processes if reduction == "mean" else total

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        longest = max(self.exchange(self.process_index, tensor.shape[dim]))
        pad = list(tensor.shape)
        pad[dim] = longest - tensor.shape[dim]
        return torch.cat([tensor, torch.full(pad, pad_index, dtype=tensor.dtype)], dim=dim)


def on_processes(processes: int, work):
    """``work(rank, accelerator)`` on ``processes`` threads; their results in rank order (a failure re-raised)."""
    exchange, results, errors = Exchange(processes), [None] * processes, []

    def run(rank):
        try:
            results[rank] = work(rank, ThreadAccelerator(exchange, rank))
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)
            exchange.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def batch(seed=0):
    """Process 0's group confident (surprisal 0.05-0.35), process 1's not (0.3-0.9); the last two tokens of rows 1
    and 6 padded."""
    g = torch.Generator().manual_seed(seed)
    surprisal = torch.cat([0.05 + 0.3 * torch.rand(4, T, generator=g), 0.3 + 0.6 * torch.rand(4, T, generator=g)])
    mask = torch.ones(N, T)
    mask[1, -2:] = mask[6, -2:] = 0
    rollout = SimpleNamespace(mask=mask, group_ids=torch.arange(N) // G, old_logps=-surprisal,
                              masked_logps=-surprisal - torch.rand(N, T, generator=g))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.2, -0.8, 0.3, -0.7])
    return advantages, rollout, {"accuracy": torch.tensor([1.0, 0, 1, 1, 0, 0, 1, 0])}


def take(rollout, rows):
    return SimpleNamespace(**{k: v[rows] for k, v in vars(rollout).items()})


def one_and_two(make_variant, update=0):
    """(advantages on one process, both processes' concatenated, the two processes' variants)."""
    advantages, rollout, scores = batch()

    def context(rows, accelerator):
        return TransformContext(advantages=advantages[rows], scores={k: v[rows] for k, v in scores.items()},
                                rollout=take(rollout, rows), update=update, total_updates=10, stats={},
                                rows=rows, accelerator=accelerator)

    alone = make_variant()
    one = alone.transform(context(torch.arange(N), None))
    variants = [make_variant() for _ in range(2)]
    halves = on_processes(2, lambda rank, acc: variants[rank].transform(
        context(torch.arange(rank * G, (rank + 1) * G), acc)))
    return one, torch.cat(halves), variants, alone


def test_global_pool_and_mean_over_processes_of_unequal_lengths():
    parts = [torch.tensor([3.0, 1.0]), torch.tensor([]), torch.tensor([2.0, float("nan"), 5.0])]
    pools = on_processes(3, lambda rank, acc: global_pool(parts[rank], acc))
    assert all(torch.equal(pool.nan_to_num(-1), torch.tensor([3.0, 1, 2, -1, 5])) for pool, _ in pools)
    assert [offset for _, offset in pools] == [0, 2, 2]
    means = on_processes(3, lambda rank, acc: global_mean(parts[rank], acc))
    assert means == [pytest.approx(11 / 4)] * 3  # the finite entries of every process
    assert global_mean(parts[0]) == 2.0 and global_mean(torch.tensor([])) == 0.0


@pytest.mark.parametrize("options", [dict(), dict(target_entropy=100.0), dict(mode="C2", target_entropy=100.0),
                                     dict(adaptive=True, target_entropy=100.0, top_ratio=0.3)])
def test_stare_gate_ranks_and_adaptive_weights_are_the_whole_batch(options):
    one, two, (rank0, rank1), alone = one_and_two(lambda: STARE(STAREOptions(**options)))
    assert torch.allclose(one, two, atol=1e-7)
    advantages, rollout, _ = batch()
    assert int(((one - advantages[:, None]).abs() > 1e-9).sum()) > 0 or "target_entropy" not in options
    if options.get("adaptive"):
        assert rank0.reweight_w == rank1.reweight_w == alone.reweight_w != 1.1


def test_stare_default_gate_reads_the_batch_entropy():
    """H over the batch is 0.376 > 0.3: no token reweighted on one process, nor on either of two (0.193 < 0.3 on
    process 0 alone reweighted two before)."""
    one, two, _, _ = one_and_two(lambda: STARE(STAREOptions()))
    advantages, rollout, _ = batch()
    assert torch.equal(one, two) and torch.equal(one, advantages[:, None] * rollout.mask)


def test_g2rpo_entropy_band_reads_the_batch_entropy():
    one, two, _, _ = one_and_two(lambda: G2RPOShaping(G2RPOShapingOptions(entropy_low=0.3, entropy_high=1.0)))
    assert torch.allclose(one, two, atol=1e-7)
    one, two, _, _ = one_and_two(lambda: G2RPOShaping(G2RPOShapingOptions(entropy_low=0.5, entropy_high=1.0)))
    assert torch.allclose(one, two, atol=1e-7)
    advantages, rollout, _ = batch()
    assert not torch.allclose(one, advantages[:, None] * rollout.mask)  # below the band: some tokens damped


def test_a_grae_accuracy_progress_is_the_batch_success_rate():
    one, two, _, _ = one_and_two(lambda: AGRAE(AGRAEOptions(reward="accuracy", progress="accuracy")))
    assert torch.allclose(one, two, atol=1e-7)


def test_vig_sample_fraction_ranks_every_process_sample():
    class Gain(VIG):  # the visual gain is the masked minus the plain log-prob: no extra pass here
        def visual_gain(self, ctx):
            return (ctx.rollout.old_logps - ctx.rollout.masked_logps) * ctx.rollout.mask

    one, two, _, _ = one_and_two(lambda: Gain(VIGOptions(sample_fraction=0.5)))
    assert torch.allclose(one, two, atol=1e-7)
    assert int((one.abs().sum(-1) > 0).sum()) == 4  # half of the 8 samples kept, not half of each process's


def test_adaptive_noise_levels_agree_when_each_process_trains_its_own_steps():
    """Rank 0 trains steps [1, 2], rank 1 [3, 4] (a random window per process): every process ends with the same
    levels, each step's spread over the samples that trained it."""
    steps, plans = 10, [torch.tensor([1, 2]), torch.tensor([3, 4])]
    g = torch.Generator().manual_seed(0)
    step_rewards = [torch.rand(4, 3, generator=g) * torch.tensor([1.0, 0.2, 3.0]) for _ in range(2)]

    def work(rank, acc):
        variant, policy = AdaptiveNoise(AdaptiveNoiseOptions(rate=0.1)), SimpleNamespace(
            step_noise_levels=torch.full((steps,), 0.7))
        variant.setup(policy, None)
        ctx = SimpleNamespace(intermediate=lambda: Intermediate(torch.zeros(4, 3, 3, 2, 2), step_rewards[rank]),
                              accelerator=acc, policy=policy, rollout=SimpleNamespace(plan=SimpleNamespace(
                                  train=plans[rank])), config=SimpleNamespace(sampling=SimpleNamespace(sde="sde")),
                              stats={}, scores={}, weights={})
        variant.rewards(ctx)
        return policy.step_noise_levels, ctx.stats

    (levels0, stats0), (levels1, stats1) = on_processes(2, work)
    assert torch.equal(levels0, levels1) and stats0 == stats1
    gains = [r[:, 1:] - r[:, :-1] for r in step_rewards]
    spread = torch.stack([gains[0][:, 0].std(), gains[0][:, 1].std(), gains[1][:, 0].std(), gains[1][:, 1].std()])
    factor = torch.exp((0.1 * torch.log(spread.mean() / spread)).clamp(-0.1, 0.1))
    assert torch.allclose(levels0[1:5], 0.7 * factor, rtol=1e-5)
    assert torch.equal(levels0[[0, 5, 6, 7, 8, 9]], torch.full((6,), 0.7))


def test_variant_stats_are_logged_as_the_mean_over_processes(monkeypatch):
    accelerators = {}  # accelerate's gather_object, per thread-process

    def gather_object(objects):
        return [x for part in accelerators[threading.get_ident()].exchange(
            accelerators[threading.get_ident()].process_index, objects) for x in part]

    def work(rank, acc):
        accelerators[threading.get_ident()] = acc
        return mean_over_processes(parts[rank], acc)

    monkeypatch.setattr("mmrl.trainer.gather_object", gather_object)
    parts = [{"vig/token_share": 0.25, "only_rank0": 1.0}, {"vig/token_share": 0.75}]
    merged = on_processes(2, work)
    assert merged[0] == merged[1] == {"vig/token_share": 0.5, "only_rank0": 1.0}
    assert mean_over_processes(parts[0], SimpleNamespace(num_processes=1)) == parts[0]
