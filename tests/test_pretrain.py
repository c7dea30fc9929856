"""`mmrl pretrain` (mmrl.pretrain): SD3 flow-matching pretraining on ShapeWorld, on a very small world.

A smoke run writes metrics, checkpoints, samples and a StableDiffusion3Pipeline folder that mmrl's flow policy loads
and samples from; on a fixed batch the loss falls (an overfitting check); a run killed mid-way and resumed ends
with exactly the weights and losses of an uninterrupted one; config mistakes are one-line errors; the loss is the
rectified-flow formula of SD3 on a case computed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fixtures import metrics_rows, one_error

from mmrl.config import ConfigError, config_from_dict
from mmrl.pretrain import (
    Pretrainer,
    build_tokenizers,
    flow_matching_loss,
    load_pretrain_config,
    main,
    prompt_words,
    run_pretrain,
    sample_flow_timesteps,
)

#: A very small world and model: 16 px, two GenEval categories, one transformer block; 3 VAE + 4 flow steps.
SMALL = {
    "image_size": 16,
    "data": {"tags": ["single_object", "colors"], "pool_size": 24},
    "text": {"max_length": 12, "clip_hidden": 8, "clip_layers": 1, "clip_heads": 2, "clip_projection": 8,
             "t5_dim": 16, "t5_layers": 1, "t5_heads": 2},
    "vae": {"block_out_channels": [8, 8], "latent_channels": 4, "steps": 3, "batch_size": 4, "stats_images": 8},
    "transformer": {"num_layers": 1, "num_heads": 2, "head_dim": 8},
    "train": {"steps": 4, "batch_size": 4, "warmup_steps": 0, "lr": 3e-3, "ema_decay": 0.5},
    "logging": {"log_every": 1, "save_every": 2, "keep_last": 5, "sample_seeds": [0], "num_sample_prompts": 2,
                "sample_steps": 2, "progress_bar": False},
}
TOTAL = 3 + 4


def write_config(path: Path, output_dir: Path, **sections) -> Path:
    data = json.loads(json.dumps(SMALL))
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    data["output_dir"] = str(output_dir)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def weights(pipeline: Path, component: str) -> dict[str, torch.Tensor]:
    files = sorted((pipeline / component).glob("*.safetensors"))
    assert files, f"no weights in {pipeline / component}"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    """An uninterrupted run (pool of 24 pairs, fresh batches from it every step)."""
    base = tmp_path_factory.mktemp("pretrain_a")
    config = write_config(base / "a.yaml", base / "run")
    pipeline = run_pretrain(config)
    assert pipeline == base / "run" / "pipeline"
    return base / "run"


def test_smoke_run_writes_metrics_checkpoints_samples_and_a_pipeline_the_policy_loads(run_a):
    from mmrl.build import build_policy
    from mmrl.checkpoint import latest_checkpoint

    rows = metrics_rows(run_a)
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))
    assert [r["stage"] for r in rows] == ["vae"] * 3 + ["flow"] * 4
    assert all(r["loss"] > 0 and r["seconds_per_step"] > 0 for r in rows)
    # the rate each step trained at (it logged the next step's: the last flow step read 0.0): no warm-up, so the
    # first flow step trains at train.lr and the last one above 0
    assert rows[3]["lr"] == pytest.approx(3e-3) and rows[-1]["lr"] > 0
    latest = latest_checkpoint(run_a / "checkpoints")
    assert latest.name == f"step_{TOTAL}"
    state = json.loads((latest / "state.json").read_text())
    assert state["step"] == TOTAL and state["stage"] == "flow"
    assert {p.name for p in (run_a / "checkpoints").iterdir()} >= {"step_2", "step_3", "step_4", "step_6", "step_7"}
    assert (run_a / "samples" / f"step_{TOTAL}.png").is_file()
    assert len((run_a / "samples" / "prompts.txt").read_text().splitlines()) == 2

    pipeline = run_a / "pipeline"
    vae_config = json.loads((pipeline / "vae" / "config.json").read_text())
    assert vae_config["scaling_factor"] == pytest.approx(state["latent_stats"]["scaling_factor"])
    assert vae_config["shift_factor"] == pytest.approx(state["latent_stats"]["shift_factor"])
    assert vae_config["scaling_factor"] != 1.0  # measured, not the constructor's placeholder

    # the EMA weights are what the pipeline holds
    ema = torch.load(latest / "ema.pt", weights_only=False)["shadow"]
    saved = weights(pipeline, "transformer")
    assert len(ema) > 10 and all(torch.equal(saved[k.removeprefix("transformer.")], v) for k, v in ema.items())

    config = config_from_dict({
        "model": {"family": "sd3", "pretrained": str(pipeline), "dtype": "float32", "resolution": 16},
        "sampling": {"max_sequence_length": 12, "num_steps": 3, "eval_num_steps": 3, "guidance_scale": 3.0},
        "data": {"prompt_list": ["a photo of a red circle"], "prompts_per_step": 1, "group_size": 2},
        "train": {"batch_size": 2}, "rewards": {"brightness": 1.0},
    })
    policy = build_policy(config)
    images = policy.sample_eval(["a photo of a red circle", "a photo of a square"], [0, 1])
    assert images.shape == (4, 3, 16, 16) and torch.isfinite(images).all()
    assert not torch.allclose(images[0], images[2])  # the prompt matters
    tokenizer = policy.family.pipe.tokenizer
    assert len(tokenizer.tokenize("circle")) == 1

    # a finished run is not trained again
    assert run_pretrain(run_a / "config.yaml") == pipeline
    assert len(metrics_rows(run_a)) == TOTAL


def test_overfit_a_fixed_batch_loss_falls(tmp_path):
    """The same images, prompts, noise and timesteps every step: both stages' losses must fall. Fresh renders (no
    pool) and jointly trained text encoders: the code paths the other tests do not take."""
    config = write_config(tmp_path / "fixed.yaml", tmp_path / "run", data={"fixed_batch": True, "pool_size": 0},
                          text={"train": True}, vae={"steps": 6, "lr": 3e-3}, train={"steps": 6, "cfg_dropout": 0.0})
    run_pretrain(config)
    rows = metrics_rows(tmp_path / "run")
    vae = [r["loss"] for r in rows if r["stage"] == "vae"]
    flow = [r["loss"] for r in rows if r["stage"] == "flow"]
    assert len(vae) == 6 and len(flow) == 6
    assert vae[-1] < 0.8 * vae[0], vae
    assert flow[-1] < 0.9 * flow[0], flow
    assert sum(b < a for a, b in zip(flow, flow[1:])) >= 4, flow
    text_encoder = weights(tmp_path / "run" / "pipeline", "text_encoder_3")
    initial = Pretrainer(load_pretrain_config(config)).c["text_encoder_3"].state_dict()
    assert any(not torch.equal(v, initial[k]) for k, v in text_encoder.items() if k in initial)  # trained


def test_killed_run_resumes_to_the_uninterrupted_result(run_a, tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path / "b.yaml", tmp_path / "run")
    original = Pretrainer.flow_step

    def dying(self, k):
        if k == 2:  # global step 6: the last checkpoint is step_4 (save_every 2), step 5 is logged and lost
            raise RuntimeError("killed")
        return original(self, k)

    monkeypatch.setattr(Pretrainer, "flow_step", dying)
    with pytest.raises(RuntimeError, match="killed"):
        run_pretrain(config)
    assert not (tmp_path / "run" / "pipeline").exists()
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1, 2, 3, 4, 5]
    monkeypatch.setattr(Pretrainer, "flow_step", original)

    capsys.readouterr()
    pipeline = run_pretrain(config)  # resume: auto (the default) continues from step_4
    assert (tmp_path / "run" / "config.resume_4.yaml").is_file()
    assert f"mmrl pretrain: resumed at step 4 of {TOTAL}" in capsys.readouterr().out  # said, as train and sft say it
    rows_a, rows_b = metrics_rows(run_a), metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows_b] == list(range(1, TOTAL + 1))
    assert [r["loss"] for r in rows_b] == [r["loss"] for r in rows_a]
    for component in ("transformer", "vae"):
        a, b = weights(run_a / "pipeline", component), weights(pipeline, component)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), component

    # what the checkpoint's weights mean cannot change on resume
    with pytest.raises(ConfigError, match="cannot resume .*transformer.num_layers"):
        run_pretrain(config, ["transformer.num_layers=2", "train.steps=6"])
    # nor the sample prompts, whose words are the text vocabulary (a new word rebuilt the frozen text encoders
    # with another vocabulary size and init under the checkpointed transformer), though other logging fields may
    with pytest.raises(ConfigError, match="cannot resume .*logging.sample_prompts"):
        run_pretrain(config, ["logging.sample_prompts=[a photo of a zebra]", "train.steps=6"])


def test_unknown_key_is_one_line_error_naming_file_line_and_nearest_key(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("seed: 1\ntrain:\n  steps: 3\n  stepz: 4\n")
    assert main([str(path)]) == 2
    line = one_error(capsys, f"{path}:4", "unknown config key 'train.stepz'", "did you mean 'train.steps'?")
    assert "Traceback" not in line
    assert main([str(tmp_path / "missing.yaml")]) == 2
    one_error(capsys, "config file not found")
    good = write_config(tmp_path / "good.yaml", tmp_path / "run")
    assert main([str(good), "vae.stepz=1"]) == 2
    one_error(capsys, "unknown config key 'vae.stepz'", "did you mean 'vae.steps'?")
    with pytest.raises(ConfigError, match="image_size must be a multiple of 4"):
        load_pretrain_config(good, ["image_size=18"])
    with pytest.raises(ConfigError, match="train.cfg_dropout"):
        load_pretrain_config(good, ["train.cfg_dropout=1.0"])
    for scale in ("-3", "5"):  # outside SD3's [-1, 2 / (pi - 2)] the clamp hid timesteps piled at the ends
        with pytest.raises(ConfigError, match=r"train.mode_scale must be in \[-1, 1.7519\]"):
            load_pretrain_config(good, ["train.weighting_scheme=mode", f"train.mode_scale={scale}"])
    assert load_pretrain_config(good, ["train.weighting_scheme=mode", "train.mode_scale=1.29"]).train.mode_scale == 1.29


def test_vae_fields_no_stage_reads_are_logged_as_ignored(tmp_path, caplog):
    good = write_config(tmp_path / "good.yaml", tmp_path / "run")
    with caplog.at_level("WARNING", logger="mmrl.pretrain"):
        load_pretrain_config(good, ["vae.pretrained=/x", "vae.steps=0", "vae.lr=50.0", "vae.latent_channels=9"])
        load_pretrain_config(good, ["init_from=/y", "vae.steps=0", "vae.stats_images=8"])
    assert "vae.lr ignored: stage 1 is skipped (vae.steps: 0)" in caplog.text
    assert "vae.latent_channels ignored: vae.pretrained brings its own architecture" in caplog.text
    assert "vae.stats_images ignored: init_from brings its VAE's latent statistics" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="mmrl.pretrain"):
        load_pretrain_config(good, ["vae.lr=5e-4", "vae.stats_images=8"])  # stage 1 runs: both read
    assert "ignored" not in caplog.text


class Recorder(torch.nn.Module):
    """Stands in for SD3Transformer2DModel: records its inputs, returns a fixed velocity."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.output = output

    def forward(self, hidden_states, timestep, return_dict=False, **cond):
        self.seen = (hidden_states.clone(), timestep.clone(), cond)
        return (self.output,)


def test_loss_is_the_rectified_flow_formula_on_a_hand_computed_case():
    # sample 0: x0 = (1, 2), noise = (3, 5), sigma = 0.25 -> x_t = 0.75 x0 + 0.25 noise = (1.5, 2.75),
    #           target noise - x0 = (2, 3), prediction (1, 1): squared errors (1, 4), mean 2.5
    # sample 1: x0 = (0, 0), noise = (1, -1), sigma = 1 -> x_t = noise = (1, -1), target (1, -1),
    #           prediction (1, 1): squared errors (0, 4), mean 2.0. The loss: (2.5 + 2.0) / 2 = 2.25
    x0 = torch.tensor([[1.0, 2.0], [0.0, 0.0]]).view(2, 2, 1, 1)
    noise = torch.tensor([[3.0, 5.0], [1.0, -1.0]]).view(2, 2, 1, 1)
    sigmas = torch.tensor([0.25, 1.0])
    timesteps = sigmas * 1000
    model = Recorder(torch.ones(2, 2, 1, 1))
    loss = flow_matching_loss(model, x0, noise, sigmas, timesteps, encoder_hidden_states="E", pooled_projections="P")
    assert loss.item() == pytest.approx(2.25)
    hidden, t, cond = model.seen
    assert torch.allclose(hidden.flatten(), torch.tensor([1.5, 2.75, 1.0, -1.0]))
    assert torch.equal(t, timesteps) and cond == {"encoder_hidden_states": "E", "pooled_projections": "P"}


def test_timesteps_are_drawn_from_the_shifted_scheduler_table():
    """diffusers' SD3 rule: index = int(u * 1000) into the training scheduler's (shifted) tables."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    shift = 3.0
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    sigmas, timesteps = sample_flow_timesteps(scheduler, 5, weighting_scheme="uniform",
                                              generator=torch.Generator().manual_seed(3))
    u = torch.rand(5, generator=torch.Generator().manual_seed(3))
    s = (1000 - (u * 1000).long()).double() / 1000  # the unshifted sigma of that table entry
    assert torch.allclose(sigmas.double(), shift * s / (1 + (shift - 1) * s), atol=1e-6)
    assert torch.allclose(timesteps, sigmas * 1000, atol=1e-3)
    ln_sigmas, _ = sample_flow_timesteps(scheduler, 4000, weighting_scheme="logit_normal", logit_mean=0.0,
                                         logit_std=1.0, generator=torch.Generator().manual_seed(0))
    # logit-normal(0, 1) puts the median of u at 0.5, i.e. sigma = 3 * 0.5 / (1 + 2 * 0.5) = 0.75 after the shift
    assert ln_sigmas.median().item() == pytest.approx(0.75, abs=0.03)


def test_tokenizers_give_every_shapeworld_word_its_own_token():
    from mmrl.data import shapeworld

    prompts = [p for split in ("train", "heldout") for p, _ in shapeworld.prompt_set(split)]
    words = prompt_words(prompts)
    assert {"circle", "squares", "red", "purple", "left", "below", "three"} <= set(words)
    clip, t5 = build_tokenizers(words, 12)
    ids = [clip.convert_tokens_to_ids(clip.tokenize(w))[0] for w in words]
    assert len(set(ids)) == len(words)
    longest = max(prompts, key=lambda p: len(clip(p).input_ids))
    assert len(clip(longest).input_ids) <= 12 and len(t5(longest).input_ids) <= 12, longest
    a, b = clip("a photo of a red circle").input_ids, clip("a photo of a blue circle").input_ids
    assert len(a) == len(b) == 8 and sum(x != y for x, y in zip(a, b)) == 1


def test_shape_noise_redraws_shapes_uniformly_at_its_rate_keeping_colour_and_box(tmp_path):
    """``data.shape_noise``: the careless annotator changes each object's shape with its probability, to either other
    shape equally often, keeps colour and box, and leaves the exact-caption stream untouched."""
    import numpy as np

    from mmrl.data import shapeworld
    from mmrl.pretrain import ShapeWorldPairs

    path = write_config(tmp_path / "c.yaml", tmp_path / "run", data={"tags": [], "shape_noise": 0.5})
    pairs = ShapeWorldPairs(load_pretrain_config(path))
    rng, noise = np.random.default_rng(0), np.random.default_rng(1)
    changed = total = 0
    to = {}
    for _ in range(300):
        _, metadata = pairs._draw(rng)
        scene = shapeworld.scene_for(metadata, rng, size=32)
        noisy = pairs.mislabel(scene, noise)
        assert len(noisy.objects) == len(scene.objects)
        for before, after in zip(scene.objects, noisy.objects):
            assert (after.color, after.box) == (before.color, before.box)
            total += 1
            if after.shape != before.shape:
                changed += 1
                to[(before.shape, after.shape)] = to.get((before.shape, after.shape), 0) + 1
    assert total > 400 and 0.42 < changed / total < 0.58
    # uniform among the other two shapes: no colour or shape rules a replacement out
    for shape in shapeworld.SHAPES:
        counts = [n for (a, _), n in to.items() if a == shape]
        assert len(counts) == 2 and min(counts) / sum(counts) > 0.3, (shape, to)

    exact = write_config(tmp_path / "e.yaml", tmp_path / "run_e", data={"tags": ["single_object"]})
    every = write_config(tmp_path / "n.yaml", tmp_path / "run_n", data={"tags": ["single_object"], "shape_noise": 1.0})
    prompts_e, images_e = ShapeWorldPairs(load_pretrain_config(exact)).render(3, 0, 12)
    prompts_n, images_n = ShapeWorldPairs(load_pretrain_config(every)).render(3, 0, 12)
    assert prompts_n == prompts_e  # the captions (and the scenes' colours and boxes) are the exact run's
    for a, b in zip(images_e, images_n):
        assert not torch.equal(a, b)  # every single shape is drawn as another one
    with pytest.raises(ConfigError, match="data.shape_noise"):
        load_pretrain_config(exact, ["data.shape_noise=1.5"])


def test_faded_washes_out_whole_images_at_its_rate_so_the_detector_sees_no_shape(tmp_path):
    """``data.faded``: each image, with its probability, is the exact image faded towards the background to
    ``FADED_CONTRAST`` (rounded), captions and scenes those of the exact run; the ShapeWorld detector finds every shape
    of an exact image and none of a faded one."""
    import numpy as np

    from mmrl.data.shapeworld import BACKGROUND
    from mmrl.pretrain import FADED_CONTRAST, ShapeWorldPairs, fade_to_background
    from mmrl.rewards.shapeworld import detect

    exact = write_config(tmp_path / "e.yaml", tmp_path / "run_e", data={"tags": ["single_object", "two_object"]})
    half = write_config(tmp_path / "h.yaml", tmp_path / "run_h",
                        data={"tags": ["single_object", "two_object"], "faded": 0.5})
    prompts_e, images_e = ShapeWorldPairs(load_pretrain_config(exact)).render(3, 0, 200)
    prompts_h, images_h = ShapeWorldPairs(load_pretrain_config(half)).render(3, 0, 200)
    assert prompts_h == prompts_e
    background = torch.tensor(BACKGROUND, dtype=torch.float32)[:, None, None]
    faded = 0
    for a, b in zip(images_e, images_h):
        if torch.equal(a, b):
            continue
        faded += 1
        expected = torch.round(background + FADED_CONTRAST * (a.float() - background))
        assert torch.equal(b.float(), expected)  # the same scene, washed out
        assert torch.equal(torch.from_numpy(fade_to_background(a.permute(1, 2, 0).numpy(), FADED_CONTRAST)),
                           b.permute(1, 2, 0))
    assert 0.40 < faded / 200 < 0.60
    for a in images_e[:20]:
        pixels = a.permute(1, 2, 0).numpy()
        assert len(detect(pixels)) >= 1 and detect(fade_to_background(pixels, FADED_CONTRAST)) == []
    with pytest.raises(ConfigError, match="data.faded"):
        load_pretrain_config(exact, ["data.faded=-0.1"])
    assert np.isclose(FADED_CONTRAST, 0.35)


def test_init_from_continues_a_saved_pipeline_and_refuses_one_that_does_not_fit(run_a, tmp_path, capsys):
    """``init_from``: the saved pipeline's weights and latent statistics are the starting point (no VAE stage), the
    flow stage trains from there; a config of other sizes or with a VAE stage is a one-line error."""
    pipeline = run_a / "pipeline"
    path = write_config(tmp_path / "ft.yaml", tmp_path / "ft", vae={"steps": 0}, train={"steps": 4})
    data = yaml.safe_load(path.read_text())
    data["init_from"] = str(pipeline)
    data["data"]["shape_noise"] = 0.5
    path.write_text(yaml.safe_dump(data, sort_keys=False))

    trainer = Pretrainer(load_pretrain_config(path))
    for component in ("transformer", "vae", "text_encoder", "text_encoder_3"):
        saved = weights(pipeline, component)
        live = trainer.c[component].state_dict()
        assert all(torch.equal(live[k], v) for k, v in saved.items()), component
    vae_config = json.loads((pipeline / "vae" / "config.json").read_text())
    assert trainer.latent_stats == {k: pytest.approx(vae_config[k]) for k in ("shift_factor", "scaling_factor")}

    out = run_pretrain(path)
    rows = metrics_rows(tmp_path / "ft")
    assert [r["stage"] for r in rows] == ["flow"] * 4
    # the statistics stay the pipeline's (its transformer was trained on them), the transformer moved
    assert json.loads((out / "vae" / "config.json").read_text())["scaling_factor"] == \
        pytest.approx(vae_config["scaling_factor"])
    before, after = weights(pipeline, "transformer"), weights(out, "transformer")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a, b) for a, b in zip(weights(pipeline, "vae").values(), weights(out, "vae").values()))

    # a run stopped after step 2 and resumed ends exactly where the uninterrupted one did
    import shutil

    shutil.rmtree(out)
    shutil.rmtree(tmp_path / "ft" / "checkpoints" / "step_4")
    assert run_pretrain(path) == out
    assert [r["loss"] for r in metrics_rows(tmp_path / "ft")] == [r["loss"] for r in rows]
    resumed = weights(out, "transformer")
    assert all(torch.equal(after[k], resumed[k]) for k in after)

    with pytest.raises(ConfigError, match="init_from .*transformer weights do not fit"):
        Pretrainer(load_pretrain_config(path, ["transformer.num_layers=2", "output_dir=" + str(tmp_path / "x")]))
    with pytest.raises(ConfigError, match="init_from brings its own VAE"):
        load_pretrain_config(path, ["vae.steps=3"])
    capsys.readouterr()
    assert main([str(path), "init_from=" + str(tmp_path), "output_dir=" + str(tmp_path / "y")]) == 2
    one_error(capsys, "not a StableDiffusion3Pipeline folder")
