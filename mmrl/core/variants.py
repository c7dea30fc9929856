"""Paper variants of the group-relative objective for grounded and video VLMs, as pure tensor functions.

Each function works on the shared shapes of DESIGN.md (``N`` samples = prompts x group size, ``T`` steps or
tokens, ``group_ids[i]`` the prompt/group of sample ``i``) and touches no model code:

* :func:`evidence_weighted_advantages` -- GA-GRPO's evidence-weighted advantages (MedScope).
* :func:`token_variance_weights` / :func:`token_weighted_advantages` -- TW-GRPO's token weighting by the
  intra-group divergence of the token distributions.
* :func:`select_informative_groups` -- DAPO's dynamic sampling filter (zero-variance groups are dropped and
  replaced by the trainer); :func:`select_top_variance_groups` -- variance-aware selection of the k most
  informative groups.
* :func:`temporal_contrast_rewards` -- Video-R1's T-GRPO temporal reward (ordered vs shuffled frames).

``ADVANTAGE_TRANSFORMS`` names the functions that map advantages to advantages (first positional argument:
the advantages), ``GROUP_FILTERS`` the ones that choose groups (return a bool mask ``[N]``), so the config can
select them by name. Group statistics come from :mod:`mmrl.core.advantages` (``group_index`` and its grouped
mean/std), never re-implemented here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from mmrl.core.advantages import _grouped_stats, group_index

NORMALIZE_MODES = ("none", "mean")


def _float(values: Tensor) -> Tensor:
    return values.double() if values.dtype == torch.float64 else values.float()


def _check_rows(name: str, values: Tensor, n: int) -> None:
    if values.shape[0] != n:
        raise ValueError(f"{name} has {values.shape[0]} samples but the advantages/rewards have {n}")


# --------------------------------------------------------------------------------------------------------
# GA-GRPO: evidence-weighted advantages
# --------------------------------------------------------------------------------------------------------


def evidence_weighted_advantages(advantages: Tensor, evidence_quality: Tensor, *, floor: float = 0.0) -> Tensor:
    """Scale each response's advantage by the quality of the evidence it grounded its answer on.

    Paper: "MedScope: Incentivizing 'Think with Videos' for Clinical Reasoning via Coarse-to-Fine Tool
    Calling", Wenjie Li, Yujie Zhang, Haoran Sun, Xingqi He, Hongcheng Gao, Chenglong Ma, Ming Hu, Guankun
    Wang, Shiyi Yao, Renhao Yang, Hongliang Ren, Lei Wang, Junjun He, Yankai Jiang (ICML 2026),
    arXiv 2602.13332. Its GA-GRPO (Grounding-Aware GRPO) optimises with "grounding-aligned rewards and
    evidence-weighted advantages": a trajectory's group-relative advantage is modulated by the fidelity of
    its evidence (IoU / timestamp alignment of its tool calls), rewarding reliable reasoning and
    suppressing ungrounded evidence. The paper's code is not released and its exact modulation formula
    was not available to us, so mmrl implements this documented, sign-aware rule:

        w_i  = floor + (1 - floor) * q_i                 (q_i = evidence quality in [0, 1], e.g. box IoU)
        A'_i = A_i * w_i          if A_i > 0             (credit shrinks with poor grounding)
        A'_i = A_i * (2 - w_i)    if A_i < 0             (blame grows with poor grounding, up to 2x)
        A'_i = 0                  if A_i = 0

    So a perfectly grounded response (q = 1) keeps its advantage unchanged, a right answer with wrong
    evidence is reinforced less (not at all with ``floor=0``), and a wrong answer with wrong evidence is
    pushed down harder. The sign of every advantage is preserved.

    Args:
        advantages: ``[N]`` or ``[N, T]`` advantages (e.g. from :func:`~mmrl.core.advantages.group_advantages`).
        evidence_quality: ``[N]`` quality of each response's cited evidence in ``[0, 1]`` (broadcast over
            ``T``). NaN means "could not be judged / no evidence task" and leaves that advantage unscaled.
        floor: the smallest weight a positive advantage can get (``w`` at ``q = 0``), in ``[0, 1]``.

    Returns:
        Advantages of the same shape as ``advantages`` (``policy_loss`` broadcasts ``[N]`` over steps).
    """
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must lie in [0, 1], got {floor}")
    if advantages.dim() not in (1, 2):
        raise ValueError(f"advantages must be [N] or [N, T], got shape {tuple(advantages.shape)}")
    quality = _float(torch.as_tensor(evidence_quality, device=advantages.device))
    if quality.dim() != 1:
        raise ValueError(f"evidence_quality must be [N], got shape {tuple(quality.shape)}")
    _check_rows("evidence_quality", quality, advantages.shape[0])
    finite = torch.isfinite(quality)
    bad = finite & ((quality < 0) | (quality > 1))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"evidence_quality must lie in [0, 1] (NaN for 'not judged'); sample {i} has {quality[i].item()}"
        )
    weight = floor + (1.0 - floor) * torch.where(finite, quality, torch.ones_like(quality))
    if advantages.dim() == 2:
        weight = weight.unsqueeze(1)
    adv = _float(advantages)
    weight = weight.to(adv.dtype)
    return torch.where(adv > 0, adv * weight, torch.where(adv < 0, adv * (2.0 - weight), torch.zeros_like(adv)))


# --------------------------------------------------------------------------------------------------------
# TW-GRPO: token weighting by intra-group divergence
# --------------------------------------------------------------------------------------------------------


def _group_kl_of_distributions(log_dists: Tensor, active: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """TW-GRPO's per-position divergence ``[N, T]`` (each row gets its group's value) from ``[N, T, V]`` log-probs."""
    n, _, vocab = log_dists.shape
    uniform = torch.full_like(log_dists, -math.log(vocab))
    logp = torch.where(active.unsqueeze(-1), log_dists, uniform)  # padding counts as the uniform distribution
    size = torch.zeros(num_groups, dtype=logp.dtype, device=logp.device).index_add(
        0, index, torch.ones(n, dtype=logp.dtype, device=logp.device))
    mean_logp = torch.zeros((num_groups,) + logp.shape[1:], dtype=logp.dtype, device=logp.device)
    mean_logp = mean_logp.index_add(0, index, logp) / size.view(-1, 1, 1)
    diff = (mean_logp[index] - logp).clamp(-11.0, 11.0)
    per_member = (torch.exp(diff) - diff - 1.0).sum(-1)  # [N, T]: k3 terms summed over the vocabulary
    group_kl = torch.zeros(num_groups, per_member.shape[1], dtype=logp.dtype, device=logp.device)
    group_kl = group_kl.index_add(0, index, per_member) / size.view(-1, 1)
    return group_kl[index]


def token_variance_weights(
    token_stats: Tensor,
    mask: Tensor,
    group_ids: Tensor | Sequence[Any],
    *,
    max_weight: float = 1.4,
    normalize: str = "none",
    eps: float = 1e-8,
) -> Tensor:
    """Per-token weights ``[N, T]`` from how much the group's responses disagree at each position (TW-GRPO).

    Paper: "Reinforcing Video Reasoning with Focused Thinking", Jisheng Dang, Jingze Wu, Teng Wang, Xuanhui
    Lin, Nannan Zhu, Hongbo Chen, Wei-Shi Zheng, Meng Wang, Tat-Seng Chua (2025), arXiv 2505.24718; code
    ``longmalongma/TW-GRPO`` (``compute_token_importance_kl_logs_uniform``, ``loss_type="tw_grpo"``,
    ``alpha=1.4``). Tokens where the group's responses diverge are decision points and get more weight;
    generic prefixes shared by all responses get less.

    With ``token_stats`` the full log-distributions ``[N, T, V]`` (log-softmax at each completion position)
    this is the anchor's rule exactly:

    1. a padded position (``mask == 0``) of a response counts as the uniform distribution ``-log V``;
    2. per group and position, the mean log-distribution ``m = mean_i logp_i`` over the group's responses;
    3. ``d_i = clamp(m - logp_i, -11, 11)``, ``kl_i = sum_v (exp(d_i) - d_i - 1)``, averaged over the group's
       responses -> one value ``kl[g, t]`` per group and position;
    4. min-max normalised over the group's positions: ``u = (kl - min) / (max - min + eps)``;
    5. ``w = 1 + (max_weight - 1) * u`` (so ``w`` is in ``[1, max_weight]``), the same for every response
       of the group at that position, times the mask.

    mmrl takes min and max over positions where at least one response of the group is active; this equals
    the anchor whenever the batch is padded to the group's longest response (otherwise the anchor's minimum
    is pulled to 0 by all-padding columns, an artefact of batch padding that mmrl does not reproduce).

    With ``token_stats`` a per-token statistic ``[N, T]`` (e.g. the sampled tokens' log-probs, or token
    entropies) the divergence in step 3 is replaced by the intra-group (biased) variance of that statistic
    over the group's active responses at each position -- the "intra-group variance" of the paper's first
    arXiv abstract -- and steps 4-5 are unchanged. This is mmrl's closest rule when only ``[N, T]`` log-probs
    are kept (the full ``[N, T, V]`` distributions cost ``V`` times more memory).

    Args:
        token_stats: ``[N, T, V]`` log-distributions (exact TW-GRPO) or ``[N, T]`` per-token statistics.
        mask: ``[N, T]`` 1 for real completion tokens, 0 for padding.
        group_ids: ``[N]`` group label of every sample.
        max_weight: the anchor's ``alpha``: weight of the most divergent position (1.4 in its trainer).
        normalize: ``"none"`` (anchor: weights in ``[1, max_weight]``) or ``"mean"`` (rescaled so the weights
            average exactly 1 over all active tokens of the batch, keeping the loss scale of plain GRPO).
        eps: the anchor's ``1e-8`` in the min-max denominator.

    Returns:
        ``[N, T]`` weights, 0 on padding, to multiply ``[N, T]`` advantages
        (see :func:`token_weighted_advantages`). In the anchor the weight multiplies the whole per-token loss,
        KL term included; mmrl weights the advantage only, which is identical when ``beta == 0`` (weights are
        positive, so ``w * min(r A, clip(r) A) = min(r w A, clip(r) w A)``).
    """
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"unknown normalize {normalize!r}; expected one of {NORMALIZE_MODES}")
    if max_weight < 1.0:
        raise ValueError(f"max_weight must be >= 1 (weights run from 1 to max_weight), got {max_weight}")
    if token_stats.dim() not in (2, 3):
        raise ValueError(
            f"token_stats must be [N, T] statistics or [N, T, V] log-probs, got {tuple(token_stats.shape)}"
        )
    n, t = token_stats.shape[:2]
    if mask.shape != (n, t):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match token_stats {(n, t)}")
    index, num_groups = group_index(group_ids)
    index = index.to(token_stats.device)
    _check_rows("group_ids", index, n)
    stats = _float(token_stats)
    active = mask.to(stats.device) > 0
    # count[i, t]: active responses of i's group at position t (from the shared grouped statistics)
    if stats.dim() == 3:
        score = _group_kl_of_distributions(stats, active, index, num_groups)
        _, _, count = _grouped_stats(active.to(stats.dtype), active, index, num_groups, 0)
    else:
        valid = active & torch.isfinite(stats)
        _, std, count = _grouped_stats(stats, valid, index, num_groups, 0)
        score = std.square()
    column = count > 0
    big = torch.finfo(score.dtype).max
    low = torch.where(column, score, torch.full_like(score, big)).min(dim=1, keepdim=True).values
    high = torch.where(column, score, torch.full_like(score, -big)).max(dim=1, keepdim=True).values
    low = torch.where(column.any(dim=1, keepdim=True), low, torch.zeros_like(low))
    high = torch.where(column.any(dim=1, keepdim=True), high, torch.zeros_like(high))
    unit = ((score - low) / (high - low + eps)).clamp(0.0, 1.0)
    weights = (1.0 + (max_weight - 1.0) * unit) * active.to(score.dtype)
    if normalize == "mean":
        total = active.sum()
        if total > 0:
            weights = weights * (total.to(weights.dtype) / weights.sum())
    return weights


def token_weighted_advantages(
    advantages: Tensor,
    token_stats: Tensor,
    mask: Tensor,
    group_ids: Tensor | Sequence[Any],
    **weight_kwargs: Any,
) -> Tensor:
    """``[N, T]`` advantages ``A * w`` with TW-GRPO's token weights ``w`` (:func:`token_variance_weights`).

    ``advantages`` ``[N]`` are broadcast over the ``T`` tokens first. Padding gets advantage 0.
    """
    weights = token_variance_weights(token_stats, mask, group_ids, **weight_kwargs)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    fits = advantages.dim() == 2 and advantages.shape[0] == weights.shape[0]
    if not fits or advantages.shape[1] not in (1, weights.shape[1]):
        raise ValueError(
            f"advantages of shape {tuple(advantages.shape)} do not fit token weights {tuple(weights.shape)}"
        )
    return _float(advantages).to(weights.dtype) * weights


# --------------------------------------------------------------------------------------------------------
# Dynamic sampling (DAPO) and variance-aware group selection
# --------------------------------------------------------------------------------------------------------


def _group_spread(rewards: Tensor, group_ids: Tensor | Sequence[Any]) -> tuple[Tensor, Tensor, Tensor, int]:
    """Biased std per sample's group ``[N, T]``, group sizes ``[N]``, group index ``[N]`` and number of groups."""
    values = _float(rewards)
    if values.dim() == 1:
        values = values.unsqueeze(1)
    if values.dim() != 2:
        raise ValueError(f"rewards must be [N] or [N, T], got shape {tuple(rewards.shape)}")
    index, num_groups = group_index(group_ids)
    index = index.to(values.device)
    _check_rows("group_ids", index, values.shape[0])
    _, std, _ = _grouped_stats(values, torch.isfinite(values), index, num_groups, 0)
    ones = torch.ones_like(values[:, :1])
    _, _, size = _grouped_stats(ones, torch.ones_like(ones, dtype=torch.bool), index, num_groups, 0)
    return std, size.squeeze(1), index, num_groups


def select_informative_groups(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Any],
    *,
    min_std: float = 0.0,
    keep_singletons: bool = True,
) -> Tensor:
    """DAPO's dynamic-sampling filter: a bool mask ``[N]`` keeping the samples of groups whose rewards differ.

    Paper: "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Qiying Yu et al. (ByteDance
    Seed / Tsinghua AIR, 2025), arXiv 2503.14476, section "Dynamic Sampling": prompts whose G outputs are
    all correct or all wrong (accuracy 1 or 0) give zero advantage and no gradient, so they are filtered out
    and more prompts are sampled until the batch is full of groups with ``0 < #correct < G``.

    mmrl mirrors the reference implementation (verl ``recipe/dapo``, ``filter_groups``): a group is kept when
    the population std (ddof 0) of its rewards is ``> min_std`` (default 0: any difference), or when it has a
    single sample (verl keeps those). NaN rewards (unjudged samples) are left out of the std; a group with
    no finite reward has std 0. mmrl's rule: a group of equal rewards has std exactly 0 (the exact zero-spread rule
    of :mod:`mmrl.core.advantages`), where verl's ``np.std`` of three fp32 0.1s is 1.4e-17 > 0 and keeps the group.
    Kept singletons get advantage 0 in mmrl (verl's GRPO gives them mean 0 and std 1, so their raw reward;
    EasyR1 refuses them). For ``[N, T]`` dense rewards a group is kept if any step column varies.
    The trainer drops the unkept samples and samples replacement groups.

    Args:
        rewards: ``[N]`` rewards (or the metric the filter uses, e.g. accuracy), or ``[N, T]`` dense rewards.
        group_ids: ``[N]`` group label of every sample.
        min_std: a group is informative when its reward std exceeds this.
        keep_singletons: keep one-sample groups (verl's behaviour).
    """
    std, size, _, _ = _group_spread(rewards, group_ids)
    keep = (std > min_std).any(dim=1)
    if keep_singletons:
        keep = keep | (size == 1)
    return keep


def select_top_variance_groups(rewards: Tensor, group_ids: Tensor | Sequence[Any], k: int) -> Tensor:
    """Variance-aware selection: a bool mask ``[N]`` keeping the ``k`` groups with the largest reward variance.

    In the spirit of the variance-aware data selection of Temporal-RLT ("Reinforcement Learning Tuning for
    VideoLLMs: Reward Design and Data Efficiency", Li et al. 2025, arXiv 2506.01908), which prefers samples
    whose repeated rollouts disagree because they carry the learning signal. mmrl's exact rule: rank the
    groups by the population variance (ddof 0) of their finite rewards (for ``[N, T]`` rewards, the mean of
    the per-column variances), keep the ``k`` largest, ties broken by the group's first appearance in the
    batch. ``k >= number of groups`` keeps everything. Combine with :func:`select_informative_groups` (``&``)
    to also exclude zero-variance groups when fewer than ``k`` groups vary.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    std, _, index, num_groups = _group_spread(rewards, group_ids)
    row_var = std.square().mean(dim=1)
    group_var = torch.zeros(num_groups, dtype=row_var.dtype, device=row_var.device)
    group_var = group_var.scatter(0, index, row_var)  # every row of a group carries the same value
    order = torch.sort(-group_var, stable=True).indices  # group_index numbers groups by first appearance
    chosen = torch.zeros(num_groups, dtype=torch.bool, device=row_var.device)
    chosen[order[:k]] = True
    return chosen[index]


# --------------------------------------------------------------------------------------------------------
# T-GRPO temporal contrast (Video-R1)
# --------------------------------------------------------------------------------------------------------


def _joint_index(a: Tensor | Sequence[Any], b: Tensor | Sequence[Any]) -> tuple[Tensor, Tensor, int]:
    """One group numbering over two label lists (ordered and shuffled rollouts)."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        joint, num = group_index(torch.cat([a.reshape(-1).cpu(), b.reshape(-1).cpu()]))
    else:
        as_list = lambda x: x.reshape(-1).tolist() if isinstance(x, Tensor) else list(x)  # noqa: E731
        joint, num = group_index(as_list(a) + as_list(b))
    n = len(a) if not isinstance(a, Tensor) else a.numel()
    return joint[:n], joint[n:], num


def temporal_contrast_rewards(
    correct_ordered: Tensor,
    correct_shuffled: Tensor,
    group_ids: Tensor | Sequence[Any],
    *,
    shuffled_group_ids: Tensor | Sequence[Any] | None = None,
    alpha: float = 0.3,
    mu: float = 0.8,
    correct_threshold: float = 0.1,
) -> Tensor:
    """T-GRPO's temporal reward bonus ``[N]`` for the responses on temporally ordered frames.

    Paper: "Video-R1: Reinforcing Video Reasoning in MLLMs", Kaituo Feng, Kaixiong Gong, Bohao Li, Zonghao
    Guo, Yibing Wang, Tianshuo Peng, Junfei Wu, Xiaoying Zhang, Benyou Wang, Xiangyu Yue (2025),
    arXiv 2503.21776; code ``tulerfeng/Video-R1``. For each question two groups are generated, one on the
    ordered frames and one on randomly shuffled frames; with ``p`` and ``p~`` the proportions of correct
    answers in each, the temporal reward ``r_t = alpha`` if ordered frames do better, else 0, and it is added
    only to the correct ordered responses (alpha = 0.3 in the paper).

    mmrl mirrors the released trainer exactly: per group,

        p  = mean accuracy of the ordered responses,  p~ = mean accuracy of the shuffled responses
        bonus_i = alpha  if  p >= mu * p~  and  accuracy_i > correct_threshold,  else 0

    with ``mu = 0.8`` and ``correct_threshold = 0.1`` as in the code (``acc_mean >= 0.8 *
    shuffled_acc_mean``, bonus on responses whose accuracy reward exceeds 0.1; for 0/1 accuracies ``p`` is
    the proportion correct). The bonus is added to the ordered responses' reward before the group-relative
    normalisation; the shuffled responses are only a baseline and are not trained on. A group with no
    shuffled rollouts (e.g. an image question in a mixed batch: the anchor applies T-GRPO to video inputs
    only) gets no bonus; NaN accuracies (unjudged) are left out of the means and get no bonus.

    Args:
        correct_ordered: ``[N]`` accuracy (bool or float) of each response on ordered frames.
        correct_shuffled: ``[M]`` accuracy of each response on shuffled frames.
        group_ids: ``[N]`` group label of each ordered response.
        shuffled_group_ids: ``[M]`` group label of each shuffled response (default ``group_ids``, requiring
            ``M == N``); the anchor samples half as many shuffled responses per question.
        alpha: the bonus; mu: the ratio the ordered accuracy must reach; correct_threshold: accuracy above
            which a response counts as correct.
    """
    ordered = torch.as_tensor(correct_ordered).double().reshape(-1)
    shuffled = torch.as_tensor(correct_shuffled).double().reshape(-1).to(ordered.device)
    if shuffled_group_ids is None:
        if shuffled.numel() != ordered.numel():
            raise ValueError(
                f"{shuffled.numel()} shuffled results for {ordered.numel()} ordered ones: "
                "pass shuffled_group_ids when the shuffled groups have a different size"
            )
        shuffled_group_ids = group_ids
    idx_o, idx_s, num_groups = _joint_index(group_ids, shuffled_group_ids)
    _check_rows("group_ids", idx_o, ordered.numel())
    _check_rows("shuffled_group_ids", idx_s, shuffled.numel())
    n = ordered.numel()
    values = torch.cat([ordered, shuffled]).unsqueeze(1)
    index = torch.cat([idx_o, idx_s]).to(values.device)
    is_ordered = torch.zeros_like(values, dtype=torch.bool)
    is_ordered[:n] = True
    finite = torch.isfinite(values)
    p, _, _ = _grouped_stats(values, finite & is_ordered, index, num_groups, 0)
    p_shuffled, _, count_shuffled = _grouped_stats(values, finite & ~is_ordered, index, num_groups, 0)
    p, p_shuffled, count_shuffled = p[:n, 0], p_shuffled[:n, 0], count_shuffled[:n, 0]
    on = (count_shuffled > 0) & (p >= mu * p_shuffled)
    correct = torch.isfinite(ordered) & (torch.nan_to_num(ordered, nan=0.0) > correct_threshold)
    bonus = torch.where(on & correct, torch.full_like(ordered, alpha), torch.zeros_like(ordered))
    return bonus.float()


def length_control_rewards(
    accuracy: Tensor,
    lengths: Tensor,
    group_ids: Tensor | Sequence[Any],
    *,
    bonus: float = 0.2,
    min_length: int = 320,
    max_length: int = 512,
    correct_threshold: float = 0.1,
) -> Tensor:
    """Video-R1's length control (``--len_control true`` in its released GRPO scripts): a bonus ``[N]`` for correct
    answers of a moderate length.

    Paper: "Video-R1: Reinforcing Video Reasoning in MLLMs", Feng et al. (2025), arXiv 2503.21776; code
    ``tulerfeng/Video-R1`` (``src/r1-v/src/open_r1/trainer/grpo_trainer.py``). mmrl mirrors the released trainer:
    in each group, when more than one response is correct (accuracy reward > ``correct_threshold``), every correct
    one whose completion has ``min_length <= tokens <= max_length`` gets ``bonus``, added to the summed reward before
    the group normalisation; nothing otherwise. ``lengths`` are completion token counts (the trained mask's,
    end-of-turn token included, as the trainer's ``completion_mask``); NaN accuracies (unjudged) are not correct.
    """
    acc = torch.as_tensor(accuracy).double().reshape(-1)
    lengths = torch.as_tensor(lengths).double().reshape(-1).to(acc.device)
    index, num_groups = group_index(group_ids)
    index = index.cpu()
    _check_rows("group_ids", index, acc.numel())
    _check_rows("lengths", lengths, acc.numel())
    correct = torch.isfinite(acc) & (torch.nan_to_num(acc, nan=0.0) > correct_threshold)
    correct_per_group = torch.zeros(num_groups, dtype=torch.long).index_add_(0, index, correct.long().cpu())
    eligible = correct & (correct_per_group[index] > 1).to(acc.device) & (lengths >= min_length) & \
        (lengths <= max_length)
    return torch.where(eligible, torch.full_like(acc, bonus), torch.zeros_like(acc)).float()


ADVANTAGE_TRANSFORMS = {
    "evidence_weighted": evidence_weighted_advantages,
    "token_variance": token_weighted_advantages,
}

GROUP_FILTERS = {
    "dynamic_sampling": select_informative_groups,
    "top_variance": select_top_variance_groups,
}
