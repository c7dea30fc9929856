"""Seed-method plug-ins (DVAO, PAPO, DRPO advantages; RGRA, Reg-GRPO, ETR, GVPO, DisCO surrogates) on cases
worked out by hand. Surrogates are checked on their value and on their gradient w.r.t. ``logps``."""

import math
from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms.base import AdvantageContext, SurrogateContext, TransformContext, VariantError, parse_spec
from mmrl.algorithms.disco import DisCO, DisCOOptions
from mmrl.algorithms.drpo import DRPO, DRPOOptions
from mmrl.algorithms.dvao import DVAO, DVAOOptions
from mmrl.algorithms.etr import ETR, ETROptions
from mmrl.algorithms.gvpo import GVPO, GVPOOptions
from mmrl.algorithms.papo import PAPO, PAPOOptions
from mmrl.algorithms.reg_grpo import RegGRPO, RegGRPOOptions
from mmrl.algorithms.rgra import RGRA, RGRAOptions

# eps = 0 keeps the hand numbers exact (group_advantages still gives 0 to zero-spread groups)
ALG = SimpleNamespace(scale="group", eps=0.0, std_ddof=0, advantage_clamp=None,
                      reward_combination="sum_then_normalize", batch_normalize_sum=False)
S3 = math.sqrt(3.0)


def actx(components, weights, labels, algorithm=ALG):
    labels = torch.tensor(labels)
    return AdvantageContext(components={k: torch.tensor(v) for k, v in components.items()}, weights=weights,
                            labels=labels, group_ids=labels, keys=[str(int(g)) for g in labels], algorithm=algorithm,
                            update=0, default=lambda: None)


def sctx(log_ratio, adv, index, group_ids=None, clip=0.2, mask=None):
    """A surrogate context whose logps (with grad) sit ``log_ratio`` above fixed old log-probs."""
    log_ratio = torch.tensor(log_ratio, dtype=torch.float32)
    old = torch.full_like(log_ratio, -1.0)
    logps = (old + log_ratio).clone().requires_grad_(True)
    lr = logps - old
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float32)
    index = torch.tensor(index)
    ctx = SurrogateContext(logps=logps, old_logps=old, log_ratio=lr, ratio=torch.exp(lr),
                           advantages=torch.tensor(adv, dtype=torch.float32).reshape(len(index), -1), mask=mask,
                           clip_low=clip, clip_high=clip, index=index,
                           group_ids=index if group_ids is None else torch.tensor(group_ids))
    return ctx


def value_and_grad(variant, ctx):
    loss = variant.surrogate(ctx)
    (grad,) = torch.autograd.grad((loss * ctx.mask).sum(), ctx.logps)
    return loss.detach(), grad


def tctx(advantages, group_ids, scores=None):
    rollout = SimpleNamespace(group_ids=torch.tensor(group_ids), mask=torch.ones(len(group_ids), 2))
    return TransformContext(advantages=torch.tensor(advantages), scores=scores or {}, rollout=rollout, update=0,
                            total_updates=1)


def config(rewards=("accuracy",), ratio_level="token", top_entropy_quantile=1.0, sampler_correction=None):
    return SimpleNamespace(rewards={r: 1.0 for r in rewards},
                           algorithm=SimpleNamespace(ratio_level=ratio_level, variants=[],
                                                     top_entropy_quantile=top_entropy_quantile,
                                                     sampler_correction=sampler_correction))


# --------------------------------------------------------------------------------------------------------- DVAO


def test_dvao_variance_shares_by_hand():
    # group 0: r1 = [1, 0, 1, 0] (std 0.5, z1 = [1, -1, 1, -1]); r2 = [2, 0, 0, 2] (std 1, z2 = [1, -1, -1, 1])
    #   power 2: omega1 = 0.25 / 1.25 = 0.2, omega2 = 0.8 -> A = 0.2 z1 + 0.8 z2 = [1, -1, -0.6, 0.6]
    # group 1: r1 = [1, 1] (no spread), r2 = [3, 1] (z2 = [1, -1]) -> omega2 = 1 -> A = [1, -1]
    ctx = actx({"r1": [1.0, 0, 1, 0, 1, 1], "r2": [2.0, 0, 0, 2, 3, 1]}, {"r1": 1.0, "r2": 1.0}, [0, 0, 0, 0, 1, 1])
    adv = DVAO().advantages(ctx)
    assert torch.allclose(adv, torch.tensor([1.0, -1, -0.6, 0.6, 1, -1]), atol=1e-6)
    # power 1 (std shares): omega = [0.5, 1] / 1.5 -> A_2 = 1/3 - 2/3 = -1/3
    adv = DVAO(DVAOOptions(power=1.0)).advantages(ctx)
    assert torch.allclose(adv, torch.tensor([1.0, -1, -1 / 3, 1 / 3, 1, -1]), atol=1e-6)
    # floor 0.5, K = 2: omega = 0.5 * [0.2, 0.8] + 0.25 = [0.35, 0.65] -> A_2 = -0.3; group 1: 0.75 z2
    adv = DVAO(DVAOOptions(floor=0.5)).advantages(ctx)
    assert torch.allclose(adv, torch.tensor([1.0, -1, -0.3, 0.3, 0.75, -0.75]), atol=1e-6)


def test_dvao_weight_enters_the_spread_and_stays_bounded():
    # w2 = 0.5 halves r2's std to 0.5: equal variance shares -> A = 0.5 z1 + 0.5 z2 = [1, -1, 0, 0]
    ctx = actx({"r1": [1.0, 0, 1, 0], "r2": [2.0, 0, 0, 2]}, {"r1": 1.0, "r2": 0.5}, [0, 0, 0, 0])
    assert torch.allclose(DVAO().advantages(ctx), torch.tensor([1.0, -1, 0, 0]), atol=1e-6)
    torch.manual_seed(0)
    comps = {"a": torch.rand(12).tolist(), "b": (5 * torch.rand(12)).tolist(), "c": torch.randn(12).tolist()}
    ctx = actx(comps, {"a": 1.0, "b": 2.0, "c": 0.3}, [0] * 6 + [1] * 6)
    adv = DVAO().advantages(ctx)
    from mmrl.core.advantages import group_advantages
    zmax = torch.stack([group_advantages(w * ctx.components[k], ctx.labels, eps=0.0, std_ddof=0).abs()
                        for k, w in ctx.weights.items()]).max(0).values
    assert (adv.abs() <= zmax + 1e-6).all()  # a convex combination never exceeds the largest objective advantage


def test_dvao_options_validate():
    with pytest.raises(ValueError, match="power"):
        DVAOOptions(power=0.0).validate()
    with pytest.raises(ValueError, match="floor"):
        DVAOOptions(floor=1.5).validate()
    with pytest.raises(VariantError, match="power"):
        parse_spec({"name": "dvao", "power": -1.0}, 0)
    assert parse_spec({"name": "dvao", "power": 1}, 0).options.power == 1.0


# --------------------------------------------------------------------------------------------------------- PAPO


def test_papo_decoupled_normalisation_by_hand():
    # group 0: outcome [1, 1, 1, 0]: mean 0.75, std sqrt(0.1875) = sqrt(3)/4 -> A_out = [1/sqrt3 x3, -sqrt3]
    #   process among the 3 correct [0.9, 0.5, 0.7]: mean 0.7, std sqrt(0.08/3) -> A_proc = [1.2247, -1.2247, 0]
    #   the incorrect answer's process score 1.0 (the best) is ignored: A_proc = 0 there
    # group 1: both correct, outcome gives 0; process [0.2, 0.6] -> A_proc = [-1, 1] (still learns)
    ctx = actx({"acc": [1.0, 1, 1, 0, 1, 1], "prm": [0.9, 0.5, 0.7, 1.0, 0.2, 0.6]}, {"acc": 1.0, "prm": 1.0},
               [0, 0, 0, 0, 1, 1])
    r = math.sqrt(1.5)  # 0.2 / sqrt(0.08 / 3)
    adv = PAPO(PAPOOptions(outcome="acc", process="prm")).advantages(ctx)
    assert torch.allclose(adv, torch.tensor([1 / S3 + r, 1 / S3 - r, 1 / S3, -S3, -1, 1]), atol=1e-5)
    adv = PAPO(PAPOOptions(outcome="acc", process="prm", process_weight=0.5)).advantages(ctx)
    assert torch.allclose(adv, torch.tensor([1 / S3 + r / 2, 1 / S3 - r / 2, 1 / S3, -S3, -0.5, 0.5]), atol=1e-5)
    # threshold 1.5: nothing is correct -> the process term vanishes everywhere, only A_out is left
    adv = PAPO(PAPOOptions(outcome="acc", process="prm", threshold=1.5)).advantages(ctx)
    assert torch.allclose(adv, torch.tensor([1 / S3, 1 / S3, 1 / S3, -S3, 0, 0]), atol=1e-5)


def test_papo_options_and_checks():
    with pytest.raises(ValueError, match="outcome and process"):
        PAPOOptions(outcome="acc").validate()
    with pytest.raises(ValueError, match="different"):
        PAPOOptions(outcome="acc", process="acc").validate()
    with pytest.raises(ValueError, match="process_weight"):
        PAPOOptions(outcome="acc", process="prm", process_weight=-1.0).validate()
    with pytest.raises(VariantError, match="process='prm' is not one of the configured rewards"):
        PAPO(PAPOOptions(outcome="accuracy", process="prm")).check(config())
    zero = SimpleNamespace(rewards={"acc": 1.0, "prm": {"weight": 0.0}}, algorithm=config().algorithm)
    with pytest.raises(VariantError, match="'prm' has weight 0"):
        PAPO(PAPOOptions(outcome="acc", process="prm")).check(zero)
    ctx = actx({"acc": [1.0, 0]}, {"acc": 1.0}, [0, 0])
    with pytest.raises(ValueError, match="'prm' does not enter the advantage"):
        PAPO(PAPOOptions(outcome="acc", process="prm")).advantages(ctx)


# --------------------------------------------------------------------------------------------------------- DRPO


def test_drpo_preference_only_shares_positive_credit_by_hand():
    # group 0: correct [1, 1, 1, 0] -> A_out = [1/sqrt3 x3, -sqrt3] (as PAPO's)
    #   preference among the correct r = [ln 1, ln 2, ln 3], lambda 1: q = [1, 2, 3] / 6, factor 3 q = [0.5, 1, 1.5]
    #   -> A = [0.5, 1, 1.5] / sqrt3 (sum sqrt3 unchanged, all > 0); the wrong one keeps -sqrt3 (its r = 9 unused)
    # group 1: both correct -> A_out = 0 -> 0 whatever the preference
    ctx = actx({"acc": [1.0, 1, 1, 0, 1, 1], "short": [0.0, math.log(2), math.log(3), 9.0, 0.0, 5.0]},
               {"acc": 1.0, "short": 1.0}, [0, 0, 0, 0, 1, 1])
    adv = DRPO(DRPOOptions(outcome="acc", preference="short")).advantages(ctx)
    assert torch.allclose(adv, torch.tensor([0.5 / S3, 1 / S3, 1.5 / S3, -S3, 0, 0]), atol=1e-5)
    # lambda 2: q ~ exp(r / 2) = [1, sqrt2, sqrt3]; factor 3 q / (1 + sqrt2 + sqrt3)
    z = 1 + math.sqrt(2) + S3
    adv = DRPO(DRPOOptions(outcome="acc", preference="short", temperature=2.0)).advantages(ctx)
    expected = torch.tensor([3 / z / S3, 3 * math.sqrt(2) / z / S3, 3 * S3 / z / S3, -S3, 0, 0])
    assert torch.allclose(adv, expected, atol=1e-5)
    # a huge lambda: uniform shares -> plain GRPO on correctness
    adv = DRPO(DRPOOptions(outcome="acc", preference="short", temperature=1e9)).advantages(ctx)
    assert torch.allclose(adv, torch.tensor([1 / S3, 1 / S3, 1 / S3, -S3, 0, 0]), atol=1e-5)


def test_drpo_nan_preference_keeps_factor_one_and_options_validate():
    # correct [1, 1, 1, 0], r = [ln 1, NaN, ln 3]: shares over the two valid ones [1/4, 3/4], factor 2 q = [0.5, 1.5];
    # the NaN one keeps factor 1 -> the same advantages as above
    ctx = actx({"acc": [1.0, 1, 1, 0], "short": [0.0, float("nan"), math.log(3), 0.0]}, {"acc": 1.0, "short": 1.0},
               [0, 0, 0, 0])
    adv = DRPO(DRPOOptions(outcome="acc", preference="short")).advantages(ctx)
    assert torch.allclose(adv, torch.tensor([0.5 / S3, 1 / S3, 1.5 / S3, -S3]), atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        DRPOOptions(outcome="acc", preference="short", temperature=0.0).validate()
    with pytest.raises(ValueError, match="name the correctness"):
        DRPOOptions(outcome="acc").validate()
    zero = SimpleNamespace(rewards={"acc": 0.0, "short": 1.0}, algorithm=config().algorithm)
    with pytest.raises(VariantError, match="'acc' has weight 0"):
        DRPO(DRPOOptions(outcome="acc", preference="short")).check(zero)
    with pytest.raises(VariantError, match="did you mean 'temperature'"):
        parse_spec({"name": "drpo", "outcome": "acc", "preference": "short", "temprature": 1.0}, 0)


# --------------------------------------------------------------------------------------------------------- RGRA


def test_rgra_reinforce_value_and_gradient_by_hand():
    # log-ratios [[0.2, 0], [0, -0.2]], A = [2, -1]: l = -A * log_ratio = [[-0.4, 0], [0, -0.2]]
    # d l / d logp = -A, independent of the ratio (PPO's would be -A * exp(0.2) on the first action)
    ctx = sctx([[0.2, 0.0], [0.0, -0.2]], [2.0, -1.0], [0, 1])
    value, grad = value_and_grad(RGRA(), ctx)
    assert torch.allclose(value, torch.tensor([[-0.4, 0.0], [0.0, -0.2]]), atol=1e-6)
    assert torch.allclose(grad, torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))
    # negative_feedback false: A -> max(A, 0), the negative row contributes nothing
    ctx = sctx([[0.2, 0.0], [0.0, -0.2]], [2.0, -1.0], [0, 1])
    value, grad = value_and_grad(RGRA(RGRAOptions(negative_feedback=False)), ctx)
    assert torch.allclose(grad, torch.tensor([[-2.0, -2.0], [0.0, 0.0]]))
    assert torch.equal(value[1], torch.zeros(2))


def test_rgra_options_and_check():
    with pytest.raises(TypeError, match="true or false"):
        RGRAOptions(negative_feedback="yes").validate()
    with pytest.raises(VariantError, match="expected true or false"):
        parse_spec({"name": "rgra", "negative_feedback": "yes"}, 0)
    with pytest.raises(VariantError, match="ratio_level=token"):
        RGRA().check(config(ratio_level="sequence"))
    RGRA().check(config())


# --------------------------------------------------------------------------------------------------------- Reg-GRPO


def test_reg_grpo_regression_value_and_gradient_by_hand():
    # s = 2, l = (2 rho - A)^2 / 4:  row A = 2, rho [0.2, 0]: [(0.4 - 2)^2, 4] / 4 = [0.64, 1]
    #                                row A = -1, rho [0, -0.2]: [1, (-0.4 + 1)^2] / 4 = [0.25, 0.09]
    # gradient 2 rho - A: [[-1.6, -2], [1, 0.6]] -- at rho = 0 it is GRPO's -A
    ctx = sctx([[0.2, 0.0], [0.0, -0.2]], [2.0, -1.0], [0, 1])
    value, grad = value_and_grad(RegGRPO(RegGRPOOptions(scale=2.0)), ctx)
    assert torch.allclose(value, torch.tensor([[0.64, 1.0], [0.25, 0.09]]), atol=1e-6)
    assert torch.allclose(grad, torch.tensor([[-1.6, -2.0], [1.0, 0.6]]), atol=1e-6)
    # the gradient vanishes at rho = A / s (the regression target) and pushes back past it
    ctx = sctx([[1.0, 1.5]], [2.0], [0])
    _, grad = value_and_grad(RegGRPO(RegGRPOOptions(scale=2.0)), ctx)
    assert torch.allclose(grad, torch.tensor([[0.0, 1.0]]), atol=1e-6)


def test_reg_grpo_options_validate():
    with pytest.raises(ValueError, match="scale"):
        RegGRPOOptions(scale=0.0).validate()
    with pytest.raises(VariantError, match="scale"):
        parse_spec({"name": "reg_grpo", "scale": -2}, 0)


# --------------------------------------------------------------------------------------------------------- ETR


def test_etr_widths_value_and_gradient_by_hand():
    # transform: group 0 accuracy [1, 0, 1, 1] -> var 0.1875, u = 4 * 0.1875 = 0.75; group 1 [1, 1] -> u = 0
    etr = ETR(ETROptions(alpha=0.5, gamma=1.0, reward="accuracy"))
    adv_in = torch.tensor([1.0, -1.0, 0.5, 0.5, 2.0, 0.0])
    out = etr.transform(tctx(adv_in.tolist(), [0, 0, 0, 0, 1, 1], {"accuracy": torch.tensor([1.0, 0, 1, 1, 1, 1])}))
    assert torch.equal(out, adv_in)
    assert torch.allclose(etr.zone, torch.tensor([0.75, 0.75, 0.75, 0.75, 0.0, 0.0]))
    # rows 0 (A 1, u .75): m = 1.5 * 1.75 = 2.625 -> [0.475, 1.525]: ratio 1.4 unclipped, l = -1.4, grad -A r = -1.4
    # row 1 (A -1, u .75): m = 2.625: ratio 0.5 > 0.475 unclipped, l = 0.5, grad 0.5 (plain PPO clips at 0.8: grad 0)
    # row 4 (A 2, u 0): m = 2 -> [0.6, 1.4]: ratio 1.5 clipped, l = -1.4 * 2 = -2.8, grad 0
    # second actions at ratio 1: l = -A, grad -A
    ctx = sctx([[math.log(1.4), 0.0], [math.log(0.5), 0.0], [math.log(1.5), 0.0]], [1.0, -1.0, 2.0], [0, 1, 4])
    value, grad = value_and_grad(etr, ctx)
    assert torch.allclose(value, torch.tensor([[-1.4, -1.0], [0.5, 1.0], [-2.8, -2.0]]), atol=1e-5)
    assert torch.allclose(grad, torch.tensor([[-1.4, -1.0], [0.5, 1.0], [0.0, -2.0]]), atol=1e-5)


def test_etr_max_scale_and_no_reward_and_options():
    # max_scale 1.5: rows 0 and 1 get m = 1.5 -> [0.7, 1.3]: ratio 1.4 clipped (l = -1.3), 0.5 clipped (l = 0.7)
    ctx = sctx([[math.log(1.4)], [math.log(0.5)]], [1.0, -1.0], [0, 1])
    etr = ETR(ETROptions(max_scale=1.5, reward="accuracy"))
    etr.transform(tctx([1.0, -1.0], [0, 0], {"accuracy": torch.tensor([1.0, 0.0])}))  # u = 1
    value, grad = value_and_grad(etr, ctx)
    assert torch.allclose(value, torch.tensor([[-1.3], [0.7]]), atol=1e-5) and torch.equal(grad, torch.zeros(2, 1))
    # no reward: u = 0, m = 1 + 0.5 |A| = 1.5 -> the same clip range
    etr = ETR()
    etr.transform(tctx([1.0, -1.0], [0, 0]))
    ctx = sctx([[math.log(1.4)], [math.log(0.5)]], [1.0, -1.0], [0, 1])
    assert torch.allclose(value_and_grad(etr, ctx)[0], torch.tensor([[-1.3], [0.7]]), atol=1e-5)
    with pytest.raises(ValueError, match="alpha"):
        ETROptions(alpha=-1.0).validate()
    with pytest.raises(ValueError, match="max_scale"):
        ETROptions(max_scale=0.5).validate()
    with pytest.raises(VariantError, match="reward='iou'"):
        ETR(ETROptions(reward="iou")).check(config())
    with pytest.raises(RuntimeError, match="transform"):
        ETR().surrogate(ctx)


# --------------------------------------------------------------------------------------------------------- GVPO


def test_gvpo_centred_regression_value_and_gradient_by_hand():
    # group 0 = samples 0..2 with centred advantages [1, -0.5, -0.5]; sample 3 alone (A = 0). beta 0.5, T = 2
    gvpo = GVPO(GVPOOptions(beta=0.5))
    gvpo.transform(tctx([1.0, -0.5, -0.5, 0.0], [0, 0, 0, 1]))
    # u = mean log-ratio = [0.3, -0.1, 0]; group mean 1/15
    # err = beta (u - 1/15) - A = [7/60 - 1, -1/12 + 1/2, -1/30 + 1/2] = [-53/60, 5/12, 7/15]; l = err^2 / 2
    # d/d logp_it of sum_t l_i = 2 * err_i * beta * (1/2) = beta err_i on each action
    ctx = sctx([[0.2, 0.4], [0.0, -0.2], [0.1, -0.1]], [1.0, -0.5, -0.5], [0, 1, 2], group_ids=[0, 0, 0])
    value, grad = value_and_grad(gvpo, ctx)
    err = torch.tensor([-53 / 60, 5 / 12, 7 / 15])
    assert torch.allclose(value, (0.5 * err.square()).unsqueeze(1).expand(3, 2), atol=1e-6)
    assert torch.allclose(grad, (0.5 * err).unsqueeze(1).expand(3, 2), atol=1e-6)
    # the detached mean loses nothing when the whole group is in the forward: the full (undetached) loss agrees
    lr = ctx.logps - ctx.old_logps
    u = lr.mean(-1)
    full = 0.5 * (0.5 * (u - u.mean()) - ctx.advantages[:, 0]).square()
    (full_grad,) = torch.autograd.grad(2 * full.sum(), ctx.logps)
    assert torch.allclose(grad, full_grad, atol=1e-6)
    # a later forward with sample 0 alone: the table holds [0.5 (fresh), -0.1, 0] -> mean 2/15,
    # err = 0.5 (0.5 - 2/15) - 1 = -49/60
    ctx = sctx([[0.5, 0.5]], [1.0], [0], group_ids=[0])
    value, grad = value_and_grad(gvpo, ctx)
    assert torch.allclose(grad, torch.full((1, 2), 0.5 * -49 / 60), atol=1e-6)


def test_gvpo_on_policy_is_beta_times_grpo_and_options():
    gvpo = GVPO(GVPOOptions(beta=0.1))
    gvpo.transform(tctx([1.0, -1.0], [0, 0]))
    # all u = 0: err = -A, gradient on each of the 2 actions beta * (-A) ... summed over them: 2 * beta * (-A) / 2
    _, grad = value_and_grad(gvpo, sctx([[0.0, 0.0], [0.0, 0.0]], [1.0, -1.0], [0, 1], group_ids=[0, 0]))
    assert torch.allclose(grad, torch.tensor([[-0.1, -0.1], [0.1, 0.1]]), atol=1e-7)
    with pytest.raises(ValueError, match="beta"):
        GVPOOptions(beta=0.0).validate()
    with pytest.raises(VariantError, match="ratio_level=token"):
        GVPO().check(config(ratio_level="sequence"))
    # per-token weights of the policy term would scale each chunk's share of the per-sample loss by its own kept
    # fraction (the update then depended on train.timestep_chunk: 25 % in the gradient at quantile 0.5)
    with pytest.raises(VariantError, match="top_entropy_quantile"):
        GVPO().check(config(top_entropy_quantile=0.2))
    with pytest.raises(VariantError, match="token_truncate weights each token"):
        GVPO().check(config(sampler_correction="token_truncate"))
    GVPO().check(config(sampler_correction="sequence_mask"))
    with pytest.raises(ValueError, match=r"one advantage per sample \[N\]"):
        GVPO().transform(tctx([[1.0, 0.0], [0.0, 1.0]], [0, 0]))
    with pytest.raises(RuntimeError, match="transform"):
        GVPO().surrogate(sctx([[0.0]], [1.0], [0]))


# --------------------------------------------------------------------------------------------------------- DisCO


def test_disco_discriminative_weights_and_kl_penalty_by_hand():
    # group 0: A = [1, -0.5, -0.5] -> one positive, two negatives of 3: c = [3/1, -3/2, -3/2]; group 1 (A = 0): c = 0
    disco = DisCO(DisCOOptions(delta=0.005, penalty=10.0))
    disco.transform(tctx([1.0, -0.5, -0.5, 0.0, 0.0], [0, 0, 0, 1, 1]))
    assert torch.allclose(disco.coef, torch.tensor([3.0, -1.5, -1.5, 0.0, 0.0]))
    # log-ratios; k3 = e^rho - 1 - rho: rho 0.2 -> 0.0214028, rho -0.2 -> 0.0187308, 0 -> 0
    # K = (0.0214028 + 0.0187308 + 0.0214028) / 8 = 0.00769205; excess = 0.00269205
    # value = -c rho + 10 excess^2 (the hinge penalty, no gradient) ; gradient = -c + 2 * 10 * excess * (e^rho - 1)
    ctx = sctx([[0.2, 0.0], [-0.2, 0.0], [0.0, 0.0], [0.0, 0.2]], [1.0, -0.5, -0.5, 0.0], [0, 1, 2, 3],
               group_ids=[0, 0, 0, 1])
    value, grad = value_and_grad(disco, ctx)
    def k(r):
        return math.exp(r) - 1 - r

    excess = (2 * k(0.2) + k(-0.2)) / 8 - 0.005
    assert abs(excess - 0.00269205) < 1e-7
    p, lam = 10 * excess ** 2, 20 * excess
    assert torch.allclose(value, torch.tensor([[-0.6 + p, p], [-0.3 + p, p], [p, p], [p, p]]), atol=1e-6)
    expected = torch.tensor([[-3 + lam * (math.exp(0.2) - 1), -3.0], [1.5 + lam * (math.exp(-0.2) - 1), 1.5],
                             [1.5, 1.5], [0.0, lam * (math.exp(0.2) - 1)]])
    assert torch.allclose(grad, expected, atol=1e-6)
    # the penalty part of the gradient is that of 10 * max(mean k3 - delta, 0)^2 over the forward's 8 actions (x 8,
    # the sum over actions the test takes): what is left after the discriminative -c
    lr = ctx.logps - ctx.old_logps
    pen = 10 * ((torch.exp(lr) - 1 - lr).mean() - 0.005).clamp(min=0).square()
    (pen_grad,) = torch.autograd.grad(8 * pen, ctx.logps)
    assert torch.allclose(grad + disco.coef[:4].unsqueeze(1), pen_grad, atol=1e-6)


def test_disco_likelihood_ratio_score_inside_budget_and_options():
    # within the budget (delta 1): no penalty; likelihood-ratio score: value -c e^rho, gradient -c e^rho
    disco = DisCO(DisCOOptions(score="likelihood_ratio", delta=1.0))
    disco.transform(tctx([1.0, -1.0], [0, 0]))  # c = [2, -2]
    value, grad = value_and_grad(disco, sctx([[0.2], [-0.2]], [1.0, -1.0], [0, 1], group_ids=[0, 0]))
    e, f = math.exp(0.2), math.exp(-0.2)
    assert torch.allclose(value, torch.tensor([[-2 * e], [2 * f]]), atol=1e-6)
    assert torch.allclose(grad, torch.tensor([[-2 * e], [2 * f]]), atol=1e-6)
    with pytest.raises(ValueError, match="score"):
        DisCOOptions(score="hinge").validate()
    with pytest.raises(ValueError, match="delta"):
        DisCOOptions(delta=-1.0).validate()
    with pytest.raises(VariantError, match="did you mean 'penalty'"):
        parse_spec({"name": "disco", "penalt": 1.0}, 0)
    with pytest.raises(VariantError, match="ratio_level=token"):
        DisCO().check(config(ratio_level="sequence"))
