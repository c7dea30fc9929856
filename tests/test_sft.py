"""``mmrl sft``: completion-only labels and loss, overfitting a small set, exact resume after a kill, the saved
folder in ``mmrl train``, and one-line errors naming the file and line."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mmrl.config import ConfigError
from mmrl.data.prompts import DataError
from mmrl.sft import (SFTRun, batch_loss, collate, completion_loss, load_sft_config, main, policy_config,
                      read_sft_data, run_sft)
from fixtures import metrics_rows

REPO = Path(__file__).parents[1]
QUIET = {"logging": {"progress_bar": False}}


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MMRL_CACHE", str(tmp_path_factory.getbasetemp() / "mmrl-cache"))
        yield


def _write_data(folder: Path, n: int = 4) -> Path:
    """``n`` tiny:grounding images (one coloured box each; the question names the colour) with an sft_target."""
    from mmrl.data.synthetic import build_grounding_set

    rows = [json.loads(line) for line in build_grounding_set(folder, num_samples=n).read_text().splitlines()]
    for row in rows:
        colour = row["question"].split()[3]
        row["sft_target"] = f"<think>The {colour} box.</think><answer>{row['solution']}</answer>"
    path = folder / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(path: Path, train_data: Path | str, /, **sections) -> Path:
    """Write an SFT config: the tiny base, short generation budget, ``train_data``, then ``sections`` merged in."""
    config = {"model": {"base": "tiny:qwen2_5_vl"}, "generation": {"max_new_tokens": 40, "max_prompt_length": 512},
              "data": {"train": str(train_data)}, **QUIET}
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _write_data(tmp_path_factory.mktemp("sft-data"))


@pytest.fixture(scope="module")
def overfit(tmp_path_factory, data):
    """60 steps on 4 lines at a constant 5e-3, evaluated (greedy answers) on the same lines at the end."""
    out = tmp_path_factory.mktemp("sft-overfit")
    cfg = _config(out / "sft.yaml", data, output_dir=str(out / "run"), data={"eval": str(data)},
                  train={"steps": 60, "batch_size": 4, "lr": 5e-3, "lr_scheduler": "constant"},
                  eval={"every": 60}, logging={"save_every": 0})
    folder = run_sft(cfg)
    return out / "run", folder


def test_labels_mask_every_prompt_token_and_the_loss_is_the_completion_cross_entropy(tmp_path, data):
    from mmrl.build import build_vlm_policy

    cfg = load_sft_config(_config(tmp_path / "sft.yaml", data, output_dir=str(tmp_path / "run")))
    policy = build_vlm_policy(policy_config(cfg, "tiny:qwen2_5_vl", str(data)))
    samples = list(read_sft_data(data, "sft_target"))[:4:3]  # red (a one-token word) and yellow (bytes): 2 lengths
    batch = collate(policy, samples)
    tok = policy.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    width = batch.completion_width
    lp = batch.input_ids.shape[1] - width
    # the prompts are the policy's rollout prompts, token for token
    rollout = policy.rollout(samples, 1, generator=torch.Generator().manual_seed(0), greedy=True)
    assert torch.equal(batch.input_ids[:, :lp], rollout.prompt_ids)
    prompt_text = tok.decode(batch.input_ids[0, :lp])
    assert cfg.generation.system_prompt in prompt_text and samples[0].question in prompt_text
    assert "<|image_pad|>" in prompt_text and prompt_text.endswith("<|im_start|>assistant\n")
    # labels by hand: -100 on every prompt token, the target tokens + <|im_end|>, then -100 on padding
    lengths = []
    for row, sample in enumerate(samples):
        ids = tok(sample.metadata["sft_target"], add_special_tokens=False)["input_ids"] + [end]
        lengths.append(len(ids))
        labels = batch.labels[row]
        assert (labels[:lp] == -100).all()
        assert labels[lp:lp + len(ids)].tolist() == ids
        assert (labels[lp + len(ids):] == -100).all()
        assert tok.decode(labels[lp:lp + len(ids)]) == sample.metadata["sft_target"] + "<|im_end|>"
        assert batch.attention_mask[row, lp:].tolist() == [1] * len(ids) + [0] * (width - len(ids))
    assert len(set(lengths)) == 2 and batch.num_tokens == sum(lengths)
    # the loss: mean token cross-entropy of the completion tokens; gradient only where the next token is labelled
    kwargs = dict(batch.model_kwargs)
    logits = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs,
                          use_cache=False).logits.float()
    logits.retain_grad()
    total, count = completion_loss(logits, batch.labels)
    assert count == sum(lengths)
    by_hand = sum(-torch.log_softmax(logits[r, t - 1], -1)[batch.labels[r, t]]
                  for r in range(len(samples)) for t in range(lp, lp + lengths[r]))
    assert torch.allclose(total, by_hand, rtol=1e-5)
    (total / count).backward()
    labelled_next = torch.zeros_like(batch.labels, dtype=torch.bool)
    labelled_next[:, :-1] = batch.labels[:, 1:] != -100
    grad = logits.grad.abs().sum(-1)
    assert (grad[~labelled_next] == 0).all()
    assert (grad[labelled_next] > 0).all()
    assert labelled_next[:, :lp - 1].sum() == 0 and labelled_next[:, lp - 1].all()  # the last prompt position only
    # the training forward keeps only the completion logits: the same loss
    with torch.no_grad():
        kept, n = batch_loss(policy, batch, train=False)
    assert n == count and torch.allclose(kept, total.detach(), rtol=1e-5)


def test_the_step_loss_is_the_token_mean_over_every_process(tmp_path, data):
    """Each process divides by the step's tokens over all processes (times P, as DDP averages gradients): with a
    stand-in reduction where the other process holds twice this one's tokens, the gradient is 2 / 3 of the one-process
    step's (it was the same: each process normalised by its own count); the logged loss is the pooled token mean."""
    from mmrl.sft import SFTRun, load_sft_config

    def fresh(name):
        return SFTRun(load_sft_config(_config(tmp_path / f"{name}.yaml", data, output_dir=str(tmp_path / name),
                                              train={"steps": 1, "batch_size": 2, "max_grad_norm": 0.0})))

    one = fresh("one").train_step()

    class TwoProcesses:  # this process's accelerator, with a second process whose sums are twice this one's
        def __init__(self, inner):
            self.inner, self.num_processes = inner, 2

        def reduce(self, tensor, reduction):
            assert reduction == "sum"
            return tensor * 3

        def __getattr__(self, name):
            return getattr(self.inner, name)

    run = fresh("two")
    run.accelerator = TwoProcesses(run.accelerator)
    two = run.train_step()
    assert two["grad_norm"] == pytest.approx(one["grad_norm"] * 2 / 3, rel=1e-5)
    assert two["tokens"] == 3 * one["tokens"] and two["loss"] == pytest.approx(one["loss"], rel=1e-6)


def test_a_few_steps_overfit_and_greedy_decoding_reproduces_the_targets(overfit):
    run, folder = overfit
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 61))
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert first > 5.0 and last < 0.2 * first and last < 0.5
    assert rows[-1]["eval/loss"] < 0.5 and rows[-1]["eval/exact_match"] >= 0.5
    answers = [json.loads(line) for line in (run / "samples" / "step_60.jsonl").read_text().splitlines()]
    exact = [a for a in answers if a["completion"] == a["target"]]
    assert exact, answers  # a training target written back exactly by greedy decoding
    assert all(a["reward/answer/iou"] == 1.0 and a["reward/think_answer_format"] == 1.0 for a in exact)
    assert rows[-1]["eval/reward/answer/iou"] > 0.5
    assert folder == run / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json"} <= \
        {p.name for p in folder.iterdir()}
    snippet = yaml.safe_load((run / "mmrl_train.yaml").read_text())
    assert snippet["model"] == {"family": "qwen_vl", "pretrained": str(folder), "dtype": "float32"}


def test_the_saved_folder_is_a_qwen_vl_policy_and_mmrl_train_updates_from_it(tmp_path, overfit, data):
    from mmrl.build import build_policy
    from mmrl.cli import main as cli_main
    from mmrl.config import load_config

    run, folder = overfit
    answers = {a["id"]: a for a in map(json.loads, (run / "samples" / "step_60.jsonl").read_text().splitlines())}
    config = load_config(REPO / "configs/tiny/vlm_grounding.yaml",
                         [f"model.pretrained={folder}", f"data.dataset={data}", "generation.max_new_tokens=40"])
    policy = build_policy(config)
    samples = list(read_sft_data(data, "sft_target"))
    greedy = policy.sample_eval(samples)
    assert greedy == [answers[s.id]["completion"] for s in samples]  # same prompts, same model as the SFT eval
    out = tmp_path / "grpo"
    assert cli_main(["train", str(REPO / "configs/tiny/vlm_grounding.yaml"), f"output_dir={out}",
                     f"model.pretrained={folder}", f"data.dataset={data}", "generation.max_new_tokens=40",
                     "train.steps=1", "logging.eval_every=0", "logging.tensorboard=false",
                     "logging.progress_bar=false"]) == 0
    (row,) = metrics_rows(out)
    assert row["reward/think_answer_format"] > 0.5 and row["reward/iou"] > 0.2  # a random model scores 0 on both
    assert row["grad_norm"] > 0


def test_resume_after_a_kill_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    # ShapeWorld lines written on the spot (grounding, counting, a video), a small custom-width base
    common = dict(model={"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                         "vision_depth": 1, "vision_hidden_size": 16, "vision_heads": 2},
                  generation={"max_new_tokens": 96, "max_prompt_length": 1024},
                  train={"steps": 4, "batch_size": 3, "lr": 2e-3, "warmup_steps": 1}, eval={"every": 0},
                  logging={"save_every": 2})
    a = _config(tmp_path / "a.yaml", "shapeworld:train:6", output_dir=str(tmp_path / "a"), **common)
    b = _config(tmp_path / "b.yaml", "shapeworld:train:6", output_dir=str(tmp_path / "b"), **common)
    run_sft(a)
    base = json.loads((tmp_path / "a" / "base" / "config.json").read_text())
    assert base["text_config"]["hidden_size"] == 32 and base["vision_config"]["hidden_size"] == 16
    tasks = [json.loads(line)["task"] for line in
             (tmp_path / "a" / "data" / "shapeworld-shapeworld-v1-train-6-qwen25-seed0" / "train.jsonl").read_text().splitlines()]
    assert set(tasks) == {"grounding", "numeric", "temporal_grounding"}

    real_step = SFTRun.train_step

    def killed_in_step_3(self):
        if self.step == 2:
            # a kill while writing the next checkpoint leaves a temporary folder behind
            (self.output_dir / "checkpoints" / ".step_3.tmp-999").mkdir()
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(SFTRun, "train_step", killed_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        run_sft(b)
    assert not (tmp_path / "b" / "model").exists()
    monkeypatch.setattr(SFTRun, "train_step", real_step)
    run_sft(b)  # resume: auto, from checkpoints/step_2
    assert [r["step"] for r in metrics_rows(tmp_path / "b")] == [1, 2, 3, 4]
    for rel in ("checkpoints/step_4/trainable.safetensors", "model/model.safetensors"):
        wa, wb = load_file(str(tmp_path / "a" / rel)), load_file(str(tmp_path / "b" / rel))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), rel
    w2 = load_file(str(tmp_path / "b" / "checkpoints" / "step_2" / "trainable.safetensors"))
    w4 = load_file(str(tmp_path / "b" / "checkpoints" / "step_4" / "trainable.safetensors"))
    assert any(not torch.equal(w2[k], w4[k]) for k in w2)
    assert metrics_rows(tmp_path / "a")[2]["loss"] == metrics_rows(tmp_path / "b")[2]["loss"]


def test_bad_config_and_data_are_one_line_errors_naming_file_and_line(tmp_path, data, capsys):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"model:\n  base: tiny:qwen2_5_vl\ndata:\n  train: {data}\ntrain:\n  steps: 3\n  stpes: 4\n")
    with pytest.raises(ConfigError, match=rf"^{cfg}:7: unknown config key 'train.stpes'; did you mean 'train.steps'\?"):
        load_sft_config(cfg)
    assert main([str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mmrl: error: {cfg}:7: unknown config key 'train.stpes'")
    cfg.write_text(f"data:\n  train: {data}\n")
    with pytest.raises(ConfigError, match=r"override 'train.lr=-1'.*train.lr: must be a number > 0"):
        load_sft_config(cfg, ["train.lr=-1"])
    cfg.write_text(f"seed: 1\ndata:\n  train: {tmp_path / 'missing.jsonl'}\n")
    with pytest.raises(ConfigError, match=rf"^{cfg}:3: data.train: file not found"):
        load_sft_config(cfg)
    recipe = load_sft_config(REPO / "configs/shapes/sft_qwen_vl.yaml")  # its data are written on the spot
    assert recipe.data.train == "shapeworld:train:3000" and recipe.model.hidden_size == 128
    cfg.write_text("model:\n  base: some/hub-model\n  hidden_size: 128\ndata:\n  train: x.jsonl\n")
    with pytest.raises(ConfigError, match=rf"^{cfg}:3: model.hidden_size: widths apply to a from-scratch base"):
        load_sft_config(cfg, check_files=False)

    # a line without its target: the file and line, before any model is built
    lines = data.read_text().splitlines()
    bad = json.loads(lines[2])
    del bad["sft_target"]
    broken = data.parent / "broken.jsonl"
    broken.write_text("\n".join([lines[0], lines[1], json.dumps(bad), lines[3]]) + "\n")
    out = tmp_path / "run"
    assert main([str(_config(cfg, broken, output_dir=str(out)))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"mmrl: error: {broken}:3: field 'sft_target' (the completion to train on")
    assert err.rstrip().endswith("is missing")
    assert not (out / "base").exists()
    with pytest.raises(DataError, match=rf"^{broken}:3: "):
        read_sft_data(broken, "sft_target")
    # a target the rollout budget could never write
    assert main([str(_config(cfg, data, output_dir=str(out), generation={"max_new_tokens": 8}))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{data}:1: field 'sft_target' is" in err and "generation.max_new_tokens=8" in err


def test_thought_dropout_empties_the_think_block_of_drawn_targets():
    import dataclasses as dc

    import torch

    from mmrl.data.vlm import VLMSample
    from mmrl.sft import EMPTY_THOUGHT, drop_thoughts

    samples = [VLMSample(id=str(i), question="q", solution="a",
                         metadata={"sft_target": f"<think>step {i}</think><answer>{i}</answer>"}) for i in range(6)]
    samples.append(dc.replace(samples[0], id="x", metadata={"sft_target": "<answer>no thought</answer>"}))
    out, dropped = drop_thoughts(samples, 1.0, torch.Generator().manual_seed(0), "sft_target")
    assert dropped == 6 and out[0].metadata["sft_target"] == f"{EMPTY_THOUGHT}<answer>0</answer>"
    assert out[6].metadata["sft_target"] == "<answer>no thought</answer>"  # nothing to drop
    assert samples[0].metadata["sft_target"] == "<think>step 0</think><answer>0</answer>"  # the source is untouched
    kept, none = drop_thoughts(samples, 0.0, torch.Generator().manual_seed(0), "sft_target")
    assert none == 0 and [s.metadata for s in kept] == [s.metadata for s in samples]
    # p = 0.5: the draws of a seeded generator decide, the same for the same seed
    half, n = drop_thoughts(samples, 0.5, torch.Generator().manual_seed(3), "sft_target")
    again, m = drop_thoughts(samples, 0.5, torch.Generator().manual_seed(3), "sft_target")
    draws = torch.rand(7, generator=torch.Generator().manual_seed(3))
    assert n == m == int((draws[:6] < 0.5).sum()) and [s.metadata for s in half] == [s.metadata for s in again]
    from mmrl.sft import load_sft_config

    with pytest.raises(Exception, match="thought_dropout must be in"):
        load_sft_config(REPO / "configs/shapes/sft_qwen_vl.yaml", ["data.thought_dropout=1.5"])


def test_rope_theta_of_a_tiny_base_reaches_the_model_and_makes_patch_columns_visible(tmp_path):
    from transformers import AutoConfig

    from mmrl.sft import SFTModelConfig, build_base_model

    folder = build_base_model(SFTModelConfig(hidden_size=64, num_heads=2, rope_theta=10.0), tmp_path / "base")
    rope = AutoConfig.from_pretrained(folder).text_config.rope_parameters
    head_dim = 32
    assert rope["rope_theta"] == 10.0 and rope["mrope_section"] == [4, 6, 6]
    default = AutoConfig.from_pretrained(build_base_model(SFTModelConfig(hidden_size=64, num_heads=2),
                                                          tmp_path / "default")).text_config.rope_parameters
    assert default["rope_theta"] == 1e6
    # M-RoPE: frequency i = theta ** (-2 i / head_dim); the columns (w) get the last section, i = 10 ... 15.
    # Across the 4 columns of a 112 px image (positions 0 ... 3) the fastest w frequency turns by:
    def turn(theta):
        return 3 * theta ** (-2 * 10 / head_dim)
    assert turn(default["rope_theta"]) < 1e-3 < 0.5 < turn(rope["rope_theta"])
    with pytest.raises(ConfigError, match="model.rope_theta: widths apply to a from-scratch base"):
        load_sft_config(_config(tmp_path / "c.yaml", "x.jsonl", model={"base": "some/hub", "rope_theta": 10}),
                        check_files=False)


def test_vision_position_std_puts_absolute_position_into_the_image_tokens_of_a_tiny_qwen3_vl(tmp_path):
    """A uniform image: every merged token has the same content except for what the learned position embeddings
    add, so their spread across the grid measures how much absolute position the tokens carry."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.sft import SFTModelConfig, build_base_model

    def spread(std):
        folder = build_base_model(SFTModelConfig(base="tiny:qwen3_vl", vision_position_std=std), tmp_path / f"{std}")
        model = AutoModelForImageTextToText.from_pretrained(folder).eval()
        weight = model.model.visual.pos_embed.weight
        image = Image.new("RGB", (112, 112), (40, 40, 40))
        inputs = AutoProcessor.from_pretrained(folder).image_processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            tokens = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        tokens = tokens.pooler_output[0]  # [16 merged tokens, hidden] of the one image
        spread = (tokens - tokens.mean(0)).norm(dim=1).mean() / tokens.norm(dim=1).mean()
        return float(weight.detach().std()), float(spread)

    default_std, default_spread = spread(None)
    std, wide_spread = spread(1.0)
    assert abs(default_std - 0.02) < 0.004 and abs(std - 1.0) < 0.1
    assert wide_spread > 5 * default_spread, (default_spread, wide_spread)
    # the same seed draws the same embeddings
    again = build_base_model(SFTModelConfig(base="tiny:qwen3_vl", vision_position_std=1.0), tmp_path / "again")
    first = AutoModelForImageTextToText.from_pretrained(tmp_path / "1.0").model.visual.pos_embed.weight
    assert torch.equal(first, AutoModelForImageTextToText.from_pretrained(again).model.visual.pos_embed.weight)
    with pytest.raises(ConfigError, match="model.vision_position_std: only a from-scratch tiny:qwen3_vl base"):
        load_sft_config(_config(tmp_path / "c.yaml", "x.jsonl", model={"base": "tiny:qwen2_5_vl",
                                                                        "vision_position_std": 1.0}),
                        check_files=False)
    with pytest.raises(ConfigError, match="model.vision_position_std: must be a number > 0"):
        load_sft_config(_config(tmp_path / "d.yaml", "x.jsonl", model={"base": "tiny:qwen3_vl",
                                                                        "vision_position_std": 0}),
                        check_files=False)


def test_timeline_targets_need_the_frame_rate_their_timestamps_were_written_for(tmp_path, capsys):
    """The temporal_grounding_timeline targets spell out the <t seconds> a Qwen3-VL prompt shows at 2 fps: another
    generation.video_fps (or a fixed frame count) would teach timestamps the prompt never shows, so it is refused."""
    from mmrl.data.shapeworld import TIMELINE_FPS

    spec = "shapeworld:train:8:temporal_grounding_timeline"
    ok = load_sft_config(_config(tmp_path / "a.yaml", spec, generation={"video_fps": TIMELINE_FPS}))
    assert ok.generation.video_fps == 2.0
    for k, generation in enumerate(({"video_fps": 4.0}, {"video_fps": None, "video_nframes": 8})):
        with pytest.raises(ConfigError, match="data.train: the temporal_grounding_timeline targets name the"):
            load_sft_config(_config(tmp_path / f"b{k}.yaml", spec, generation=generation))
    # other ShapeWorld tasks read at any rate
    assert load_sft_config(_config(tmp_path / "c.yaml", "shapeworld:train:8:temporal_grounding",
                                   generation={"video_fps": 4.0})).generation.video_fps == 4.0
    # and they copy Qwen3-VL's timestamps: a base whose prompt has none is refused before any data is written
    cfg = _config(tmp_path / "d.yaml", spec, output_dir=str(tmp_path / "run"))  # the helper's tiny:qwen2_5_vl
    assert main([str(cfg)]) == 2
    assert "a qwen2_5_vl, whose prompt has none" in capsys.readouterr().err
    assert not (tmp_path / "run" / "data").exists()


def test_config_validate_checks_the_sft_data_lines(tmp_path, capsys, data):
    """`mmrl config validate` on an `mmrl sft` config reads every line of its data as `mmrl train` validation does
    (media decoded unless --quick) and each line's target field; `--quick` on a pretrain config, which has no data
    lines, is a usage error rather than a flag that does nothing."""
    from mmrl.cli import main as cli

    cfg = tmp_path / "sft.yaml"
    assert cli(["config", "validate", str(_config(cfg, data))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{cfg}: ok (an `mmrl sft` config)",
                   f"  data train: {data}: 4 line(s), 4 usable, 0 bad; 4 image(s) and 0 video(s) decoded"]
    good, _, missing, _ = [json.loads(line) for line in data.read_text().splitlines()]
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    rows = [good | {"image": str(data.parent / good["image"])}, good | {"image": "images/bad.png"},
            {k: v for k, v in missing.items() if k != "sft_target"} | {"image": str(data.parent / missing["image"])}]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli(["config", "validate", str(_config(cfg, broken))]) == 2
    err = capsys.readouterr().err
    assert f"{broken}:2:" in err and "bad.png" in err  # the decode found the damaged image
    assert cli(["config", "validate", "--quick", str(_config(cfg, broken))]) == 2  # not decoded: the target is next
    assert capsys.readouterr().err.startswith(f"mmrl: error: {broken}:3: field 'sft_target'")
    assert cli(["config", "validate", "--quick", str(_config(cfg, broken, data={"skip_bad_samples": True}))]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        f"  data train: {broken}: 3 line(s), 3 usable, 0 bad; 3 image(s) and 0 video(s) found (not decoded: quick "
        f"check); 1 without 'sft_target' skipped")
    pretrain = Path(__file__).parents[1] / "configs" / "shapes" / "pretrain_sd3.yaml"
    assert cli(["config", "validate", "--quick", str(pretrain)]) == 2
    assert "an `mmrl pretrain` config renders its images; it has no data lines" in capsys.readouterr().err
