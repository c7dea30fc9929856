"""Flow policy correctness that a broken mode or dtype would silently violate (tiny SD3, CPU):

* train / eval mode: LoRA dropout (``model.lora_dropout``) acts only in the gradient-carrying forward of
  ``logprobs``; rollouts, old log-probs and the reference run in eval mode, so with dropout 0 the first ratio is
  exactly 1;
* gradient checkpointing really checkpoints the training forward, changes no log-prob and no gradient, also with
  dropout (the backward recomputation sees the forward's train mode and dropout masks);
* full fine-tuning in bfloat16: trainable weights in fp32, the frozen reference in the load dtype, KL computable.
"""

import pytest
import torch

from mmrl.core.losses import policy_loss
from mmrl.pipelines.flow.policy import FlowPolicy
from mmrl.pipelines.flow.sd3 import SD3Family

from test_flow_policy import LORA, make_policy, tiny_sd3  # noqa: E402,F401  (the policy tests' fixtures)


# ------------------------------------------------------------------------------ train/eval mode, LoRA dropout


def _nonzero_lora(policy, scale=0.05, seed=7):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_trainable_parameters().items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def test_lora_dropout_zero_grad_forward_replays_rollout(tiny_sd3):
    policy = make_policy(tiny_sd3, lora={**LORA, "dropout": 0.0})
    _nonzero_lora(policy)
    rollout = policy.rollout(["a cat", "a dog"], 2, generator=torch.Generator().manual_seed(0))
    assert not policy.transformer.training  # sampling runs in eval mode
    out = policy.logprobs(rollout, torch.arange(4))
    assert out.logps.requires_grad and policy.transformer.training  # the gradient-carrying forward: train mode
    # the replay batches rows x steps, the sampler one step's rows: on some CPUs (AVX-512 / AMX kernels chosen by
    # matrix shape) the two differ in the last bit, so "the same log-prob" is to float32 rounding (1e-6)
    torch.testing.assert_close(out.logps, rollout.old_logps, atol=1e-6, rtol=0)
    loss = policy_loss(out.logps, rollout.old_logps, torch.tensor([1.0, -1.0, 0.5, -0.5]), clip_low=1e-4)
    assert abs(loss.metrics["ratio/min"].item() - 1.0) <= 1e-6 and abs(loss.metrics["ratio/max"].item() - 1.0) <= 1e-6


def test_lora_dropout_acts_only_in_the_gradient_carrying_forward(tiny_sd3):
    policy = make_policy(tiny_sd3, lora={**LORA, "dropout": 0.5})
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.5 for m in policy.transformer.modules())
    _nonzero_lora(policy)
    rollout = policy.rollout(["a cat", "a dog"], 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # old log-probs (trainer._old_logps): eval mode, the rollout's numbers
        old = policy.logprobs(rollout, torch.arange(4))
    assert not policy.transformer.training
    torch.testing.assert_close(old.logps, rollout.old_logps, atol=1e-6, rtol=0)
    out = policy.logprobs(rollout, torch.arange(4))  # training forward: dropout on
    assert policy.transformer.training
    assert not torch.allclose(out.logps, rollout.old_logps, atol=1e-6, rtol=0)
    # back to eval for the next rollout / eval grid, whatever the previous call left
    again = policy.rollout(["a cat", "a dog"], 2, generator=torch.Generator().manual_seed(0))
    assert not policy.transformer.training and torch.equal(again.old_logps, rollout.old_logps)


def test_reference_forward_runs_in_eval_mode(tiny_sd3):
    policy = make_policy(tiny_sd3, lora={**LORA, "dropout": 0.5})
    rollout = policy.rollout(["a cat"], 2, generator=torch.Generator().manual_seed(3))
    seen = []
    handle = policy.transformer.register_forward_pre_hook(lambda m, args: seen.append(m.training))
    try:
        out = policy.logprobs(rollout, torch.arange(2), with_kl=True)
    finally:
        handle.remove()
    assert seen == [False, True]  # reference (no grad, adapters off) first, then the training forward
    assert torch.equal(out.kl, torch.zeros_like(out.kl))  # fresh LoRA (B = 0): dropout of a zero update is zero


def _grads(policy, rollout, seed):
    policy.transformer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks
    out = policy.logprobs(rollout, torch.arange(len(rollout)))
    out.logps.sum().backward()
    return out.logps.detach(), {n: p.grad.clone() for n, p in policy.named_trainable_parameters().items()}


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_gradient_checkpointing_checkpoints_the_training_forward(tiny_sd3, monkeypatch, dropout):
    policy = make_policy(tiny_sd3, lora={**LORA, "dropout": dropout}, gradient_checkpointing=True)
    _nonzero_lora(policy)
    calls = []
    checkpoint = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    rollout = policy.rollout(["a cat", "a dog"], 2, generator=torch.Generator().manual_seed(0))
    assert calls == []  # no-grad forwards are never checkpointed
    logps, with_ckpt = _grads(policy, rollout, seed=11)
    blocks = len(policy.transformer.transformer_blocks)
    assert calls == [True] * blocks  # one checkpointed call per transformer block in the training forward
    if dropout == 0.0:
        torch.testing.assert_close(logps, rollout.old_logps, atol=1e-6, rtol=0)  # checkpointing changes no log-prob
    policy.transformer.disable_gradient_checkpointing()
    logps_plain, plain = _grads(policy, rollout, seed=11)
    assert len(calls) == blocks
    # the backward recomputation saw the same (train) mode and dropout masks as the forward
    torch.testing.assert_close(logps, logps_plain, rtol=0, atol=0)
    for name in plain:
        torch.testing.assert_close(with_ckpt[name], plain[name], rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------------ full fine-tuning in a low-precision dtype


def test_full_finetuning_reference_keeps_the_load_dtype(tiny_sd3):
    family = SD3Family.from_pretrained(str(tiny_sd3), dtype=torch.bfloat16, max_sequence_length=32)
    policy = FlowPolicy(family, num_steps=6, eval_num_steps=6, resolution=32, guidance_scale=4.5, lora=None)
    assert policy.load_dtype == torch.bfloat16
    assert {p.dtype for p in policy.trainable_parameters()} == {torch.float32}
    rollout = policy.rollout(["a cat"], 2, generator=torch.Generator().manual_seed(0))
    policy.init_reference()
    ref = policy._reference_model
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    # the reference holds the initial weights: bf16 -> fp32 -> bf16 is exact
    for (name, p), q in zip(policy.transformer.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16), q), name
    out = policy.logprobs(rollout, torch.arange(2), with_kl=True)
    assert out.kl.shape == out.logps.shape and torch.isfinite(out.kl).all() and (out.kl >= 0).all()
    # before any update the only difference is fp32 vs bf16 arithmetic: a tiny KL
    assert out.kl.max().item() < 1e-2
    assert torch.isfinite(out.logps).all() and out.logps.requires_grad
    with torch.no_grad():  # the output projection: a shift of the patch embedding's weights is normalised away
        policy.transformer.proj_out.weight.add_(0.5)
    moved = policy.logprobs(rollout, torch.arange(2), with_kl=True).kl
    assert moved.sum() > 100 * out.kl.sum()

