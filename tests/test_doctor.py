"""mmrl doctor: every check passes on a correct port (flow and VLM, LoRA and full fine-tuning) and fails on a broken
one (a sampler recording wrong log-probs, an export that does not carry the trained weights)."""
from pathlib import Path

import pytest
import torch
from fixtures import TINY_RECIPE

from mmrl.config import load_config
from mmrl.doctor import run_doctor

FLOW_CHECKS = ["rewards_finite", "replay_matches_rollout", "first_ratio_is_one", "reference_is_base",
               "sde_zero_noise_is_ode", "export_reloads"]


def by_name(checks):
    return {c.name: c for c in checks}


def test_doctor_passes_on_the_flow_policy(tmp_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    checks = run_doctor(load_config(TINY_RECIPE, [f"output_dir={tmp_path}"]))
    assert [p.name for p in scratch.glob("mmrl-doctor-*")] == [], "the doctor's temporary run folder is left behind"
    assert [c.name for c in checks] == FLOW_CHECKS
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert "after perturbing the trainable weights" in by_name(checks)["reference_is_base"].figure


def test_doctor_catches_a_broken_sampler_and_a_broken_export(tmp_path, monkeypatch, capsys):
    from mmrl.cli import main
    from mmrl.pipelines.flow.policy import FlowPolicy

    rollout = FlowPolicy.rollout

    def off_by_a_little(self, *args, **kwargs):  # a sampler whose recorded log-probs are not the policy's
        out = rollout(self, *args, **kwargs)
        out.old_logps = out.old_logps + 1e-3
        return out

    monkeypatch.setattr(FlowPolicy, "rollout", off_by_a_little)
    from peft.utils import get_peft_model_state_dict

    monkeypatch.setattr(FlowPolicy, "lora_state_dict",  # an export that writes the untrained (zero) update
                        lambda self, state_dict=None: {k: torch.zeros_like(v) for k, v in
                                                       get_peft_model_state_dict(self.transformer).items()})
    checks = by_name(run_doctor(load_config(TINY_RECIPE, [f"output_dir={tmp_path}"])))
    assert not checks["replay_matches_rollout"].ok and "= 0.001" in checks["replay_matches_rollout"].figure
    assert not checks["export_reloads"].ok
    assert checks["reference_is_base"].ok and checks["sde_zero_noise_is_ode"].ok  # the rest still holds
    assert main(["doctor", str(TINY_RECIPE), f"output_dir={tmp_path}"]) == 1
    out = capsys.readouterr().out
    assert "FAIL replay_matches_rollout" in out and "failed: replay_matches_rollout, export_reloads" in out


@pytest.mark.parametrize("lora", [True, False])
def test_doctor_passes_on_the_vlm_policy(tmp_path, lora):
    config = load_config(Path(TINY_RECIPE).parent / "vlm_grounding.yaml",
                         [f"output_dir={tmp_path}", f"model.use_lora={str(lora).lower()}"])
    checks = run_doctor(config)
    expected = [n for n in FLOW_CHECKS if n != "sde_zero_noise_is_ode"]
    assert [c.name for c in checks] == expected[:2] + ["prompt_sharing_matches_full_rows"] + expected[2:]
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert "each prompt once" in by_name(checks)["prompt_sharing_matches_full_rows"].figure
    assert ("PEFT" if lora else "full model") in by_name(checks)["export_reloads"].figure


def test_doctor_catches_a_prompt_sharing_forward_that_differs_from_full_rows(tmp_path, monkeypatch):
    """A model whose KV-cache handling broke the prompt-shared pass (here: its logits scaled) fails that check, and
    the check says where sharing is off."""
    from mmrl.pipelines.vlm.qwen import QwenVLPolicy

    recipe = Path(TINY_RECIPE).parent / "vlm_grounding.yaml"
    shared = QwenVLPolicy._prefix_shared_logits
    monkeypatch.setattr(QwenVLPolicy, "_prefix_shared_logits",
                        lambda self, *a, **k: shared(self, *a, **k) * 1.1)  # another temperature
    checks = by_name(run_doctor(load_config(recipe, [f"output_dir={tmp_path}"])))
    assert not checks["prompt_sharing_matches_full_rows"].ok
    monkeypatch.undo()
    off = by_name(run_doctor(load_config(recipe, [f"output_dir={tmp_path}", "model.share_prompt_prefix=false"])))
    assert off["prompt_sharing_matches_full_rows"].ok and "not used" in off["prompt_sharing_matches_full_rows"].figure


def test_doctor_compares_a_rollout_engine_with_the_trained_model(tmp_path, monkeypatch):
    """With a rollout engine (generation.engine: vllm) the doctor compares the engine's log-probs of the sampled tokens
    with the trained model's: here an engine that reports them (the trained model's own) within the tolerance passes,
    one off by 0.5 nats on one token fails. The real engine is checked in test_vllm_engine.py where vLLM runs."""
    from mmrl.pipelines.vlm.qwen import QwenVLPolicy

    recipe = Path(TINY_RECIPE).parent / "vlm_grounding.yaml"
    original = QwenVLPolicy.rollout

    def engine_rollout(offset):
        def rollout(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            with torch.no_grad():
                logps = self.logprobs(out, torch.arange(len(out))).logps.float()
            logps[0, 0] += offset
            out.sampler_logps = logps * out.mask
            return out
        return rollout

    monkeypatch.setattr(QwenVLPolicy, "rollout", engine_rollout(0.0))
    good = by_name(run_doctor(load_config(recipe, [f"output_dir={tmp_path}"])))["rollout_engine_matches_trainer"]
    assert good.ok and "log p hf - log p trained model" in good.figure
    monkeypatch.setattr(QwenVLPolicy, "rollout", engine_rollout(0.5))
    bad = by_name(run_doctor(load_config(recipe, [f"output_dir={tmp_path}"])))["rollout_engine_matches_trainer"]
    assert not bad.ok and "= 0.5" in bad.figure


def test_doctor_runs_the_trainers_mixed_precision_and_keeps_checking_after_a_crash(tmp_path, monkeypatch):
    """train.mixed_precision=bf16: the doctor replays under the trainer's autocast (one context per pass: autocast
    caches its weight casts within a context, which hid the perturbed weights, KL 0 after perturbing), so a correct
    port passes; a check that raises is that check's FAIL with the message, and the others still report."""
    from accelerate.state import AcceleratorState

    from mmrl.pipelines.flow.policy import FlowPolicy

    AcceleratorState._reset_state()  # accelerate's process-wide state keeps its mixed precision: reset around bf16
    try:
        checks = run_doctor(load_config(TINY_RECIPE, [f"output_dir={tmp_path}", "train.mixed_precision=bf16"]))
    finally:
        AcceleratorState._reset_state()
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert float(by_name(checks)["reference_is_base"].figure.split("trainable weights ")[1].split(";")[0]) > 0

    def broken_export(self, directory, state_dict=None):
        raise RuntimeError("no LoRA module named to_q")

    monkeypatch.setattr(FlowPolicy, "export", broken_export)
    checks = by_name(run_doctor(load_config(TINY_RECIPE, [f"output_dir={tmp_path}"])))
    assert not checks["export_reloads"].ok
    assert checks["export_reloads"].figure == "raised RuntimeError: no LoRA module named to_q"
    assert [c for c in checks if c != "export_reloads" and not checks[c].ok] == []


def _sampler_velocity_off(monkeypatch, factor):
    from mmrl.pipelines.flow.policy import FlowPolicy

    velocity = FlowPolicy._velocity

    def sampler_off(self, model, x, step, timesteps, cond):
        v = velocity(self, model, x, step, timesteps, cond)
        return v * factor if not torch.is_grad_enabled() and self._sampling else v

    rollout = FlowPolicy.rollout

    def flagged(self, *args, **kwargs):
        self._sampling = True
        try:
            return rollout(self, *args, **kwargs)
        finally:
            self._sampling = False

    monkeypatch.setattr(FlowPolicy, "_sampling", False, raising=False)
    monkeypatch.setattr(FlowPolicy, "_velocity", sampler_off)
    monkeypatch.setattr(FlowPolicy, "rollout", flagged)


def test_doctor_catches_a_sampler_whose_velocity_is_off_by_1e_4(tmp_path, monkeypatch):
    """A flow log-prob is a mean over the latent's elements, so a sampler velocity 1e-4 off moves it by about 1e-6:
    the fp32 flow tolerance (5e-7) catches it, where 2e-6 let it through (and 1e-5 a velocity 5e-4 off)."""
    _sampler_velocity_off(monkeypatch, 1 + 1e-4)
    check = by_name(run_doctor(load_config(TINY_RECIPE, [f"output_dir={tmp_path}"])))["replay_matches_rollout"]
    assert not check.ok and "(tolerance 5e-07)" in check.figure


def test_doctor_catches_a_sampler_2_percent_off_under_bf16_autocast(tmp_path, monkeypatch):
    """Under bf16 the flow log-prob tolerance is 5e-4, not the per-token 2e-2 (which passed a velocity 20 % off)."""
    from accelerate.state import AcceleratorState

    _sampler_velocity_off(monkeypatch, 1.05)
    AcceleratorState._reset_state()  # accelerate's process-wide state keeps its mixed precision: reset around bf16
    try:
        check = by_name(run_doctor(load_config(TINY_RECIPE, [f"output_dir={tmp_path}",
                                                             "train.mixed_precision=bf16"])))["replay_matches_rollout"]
    finally:
        AcceleratorState._reset_state()
    assert not check.ok and "(tolerance 0.0005)" in check.figure


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_doctor_catches_a_lora_scaled_differently_in_the_training_pass(tmp_path, monkeypatch, dropout):
    """A training (gradient) pass that applies the LoRA at twice its scale: the first ratio is not 1 once the LoRA
    is trained. The batch is sampled and replayed with the trainable weights moved off their start (an untrained
    LoRA adds nothing: every check passed), and LoRA dropout is set to 0 for the check instead of skipping it."""
    from peft.tuners.lora.layer import Linear

    linear_forward = Linear.forward

    def doubled(self, x, *args, **kwargs):
        out = linear_forward(self, x, *args, **kwargs)
        if torch.is_grad_enabled():  # the LoRA's part once more: base + 2 * delta
            out = 2 * out - self.base_layer(x)
        return out

    monkeypatch.setattr(Linear, "forward", doubled)
    checks = by_name(run_doctor(load_config(TINY_RECIPE, [f"output_dir={tmp_path}",
                                                          f"model.lora_dropout={dropout}"])))
    assert not checks["first_ratio_is_one"].ok, checks["first_ratio_is_one"]
    assert checks["replay_matches_rollout"].ok and checks["sde_zero_noise_is_ode"].ok


def test_doctor_ratio_check_passes_with_lora_dropout(tmp_path):
    check = by_name(run_doctor(load_config(TINY_RECIPE, [f"output_dir={tmp_path}", "model.lora_dropout=0.3"])))[
        "first_ratio_is_one"]
    assert check.ok and "lora_dropout 0.3 set to 0 for the check" in check.figure and "= 0 " in check.figure


def test_doctor_catches_a_reference_that_leaves_one_adapter_on(tmp_path, monkeypatch):
    """A reference pass that disables every LoRA layer but one: its KL is 0 before any update (the LoRA starts at 0)
    and not 0 after the perturbation, so the KL figures pass; the reference's log-probs against the base model
    loaded afresh do not."""
    import contextlib

    from peft.tuners.tuners_utils import BaseTunerLayer

    from mmrl.pipelines.flow.policy import FlowPolicy

    reference = FlowPolicy.reference

    @contextlib.contextmanager
    def leaky(self):
        with reference(self) as model:
            layer = next(m for m in model.modules() if isinstance(m, BaseTunerLayer))
            layer.enable_adapters(True)
            try:
                yield model
            finally:
                layer.enable_adapters(False)

    monkeypatch.setattr(FlowPolicy, "reference", leaky)
    check = by_name(run_doctor(load_config(TINY_RECIPE, [f"output_dir={tmp_path}"])))["reference_is_base"]
    assert not check.ok and "max |KL| before any update 0;" in check.figure
    assert float(check.figure.split("base loaded afresh| = ")[1].split(" ")[0]) > 2e-6
