"""The ShapeWorld recipes (configs/shapes/) and the shipped bases (assets/shapeworld/).

Each shipped base loads by its name (``shapeworld:sd3``, ``shapeworld:qwen_vl``, ``shapeworld:qwen_vl_grounding``),
records the recipe that made it, and scores clearly above a random tiny model of its family on held-out ShapeWorld
data under the same protocol (the grounding base also above itself shown a blank image); one update of each GRPO
recipe runs on it. Sizes are cut down (fewer prompts, images and steps); what is asserted is
behaviour, never timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures import metrics_rows, tiny_flow_config
from mmrl.cli import main
from mmrl.config import load_config
from mmrl.pretrain import load_pretrain_config
from mmrl.data.shapeworld import base_model_path

REPO = Path(__file__).resolve().parents[1]
SHAPES = REPO / "configs" / "shapes"
#: A cut-down protocol for the held-out comparison: the first 12 held-out prompts (two per GenEval category).
HELDOUT = ["benchmarks=[shapeworld@heldout]", "limit=12", "images_per_prompt=2", "num_steps=20", "resolution=32",
           "progress=false"]
#: One small update of a recipe.
ONE_UPDATE = ["train.steps=1", "data.prompts_per_step=1", "data.group_size=2", "sampling.num_steps=3",
              "sampling.eval_num_steps=3", "train.batch_size=2", "train.gradient_accumulation_steps=1",
              "logging.eval_every=0", "logging.progress_bar=false", "logging.tensorboard=false", "eval.every=0"]


def _heldout(config: Path | str, out: Path, *extra: str) -> dict:
    assert main(["eval", str(config), "checkpoint=base", *HELDOUT, f"output_dir={out}", *extra]) == 0
    return json.loads((out / "summary.json").read_text())["benchmarks"]["shapeworld@heldout"]["metrics"]


def test_the_shipped_base_loads_by_name_and_beats_a_random_model_on_held_out_prompts(tmp_path):
    folder = base_model_path("sd3")
    assert (folder / "model_index.json").is_file() and (folder / "mmrl_pretrain.yaml").is_file()
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 10 * 2 ** 20, f"the shipped base is {size / 2 ** 20:.1f} MiB"
    base = _heldout(SHAPES / "flow_grpo.yaml", tmp_path / "base")
    (tmp_path / "random").mkdir()
    random = _heldout(tiny_flow_config(tmp_path / "random", cached=True), tmp_path / "random_eval")
    assert random["overall"] <= 0.05
    assert base["overall"] >= random["overall"] + 0.08, (base, random)
    assert base["partial"]["mean"] > random["partial"]["mean"]


@pytest.mark.parametrize("recipe, extra", [
    ("flow_grpo.yaml", ["sampling.window_size=2"]),
    ("dense_grpo.yaml", ["sampling.window_size=2"]),
    ("tp_grpo.yaml", ["sampling.window_size=2"]),
])
def test_one_update_of_each_shapes_recipe_on_the_shipped_base(recipe, extra, tmp_path):
    config = load_config(SHAPES / recipe)
    assert config.model.pretrained == "shapeworld:sd3" and config.data.prompts == "shapeworld:train"
    assert config.eval.benchmarks == ["shapeworld@heldout"]
    run = tmp_path / "run"
    assert main(["train", str(SHAPES / recipe), f"output_dir={run}", *ONE_UPDATE, *extra]) == 0
    row = metrics_rows(run)[-1]
    assert row["step"] == 1 and 0.0 <= row["reward/mean"] <= 1.0
    assert row["samples/nan_reward"] == 0.0
    assert (run / "checkpoints" / "step_1" / "trainable.safetensors").is_file()


def test_the_shipped_sd3_base_records_the_recipe_that_made_it():
    import dataclasses

    import yaml

    from mmrl.pretrain import pretrain_config_from_dict

    shipped = yaml.safe_load((base_model_path("sd3") / "mmrl_pretrain.yaml").read_text())
    # read as a config (unknown keys refused; fields added since then take their defaults, which reproduce the run)
    assert dataclasses.asdict(pretrain_config_from_dict(shipped)) == \
        dataclasses.asdict(load_pretrain_config(SHAPES / "pretrain_sd3.yaml"))


def _continued_base(name: str, recipe_file: str):
    """The shipped base ``shapeworld:<name>``: a few MB, and made by ``recipe_file`` exactly (the recipe it records
    is that file's config); returns that config."""
    import dataclasses

    import yaml

    from mmrl.pretrain import pretrain_config_from_dict

    folder = base_model_path(name)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 10 * 2 ** 20, f"the shipped base is {size / 2 ** 20:.1f} MiB"
    recipe = load_pretrain_config(SHAPES / recipe_file)
    shipped = yaml.safe_load((folder / "mmrl_pretrain.yaml").read_text())
    assert dataclasses.asdict(pretrain_config_from_dict(shipped)) == dataclasses.asdict(recipe)
    assert recipe.init_from == "shapeworld:sd3"
    return recipe


def _base_eval(recipe_file: Path, benchmark: str, out: Path, *extra: str) -> tuple[dict, list[dict]]:
    """The base of ``recipe_file`` (or ``model.pretrained=`` in ``extra``) on ``benchmark``, 20 steps: its metrics and
    its sample rows."""
    args = [f"benchmarks=[{benchmark}]", "num_steps=20", "resolution=32", "progress=false"]
    assert main(["eval", str(recipe_file), "checkpoint=base", *args, f"output_dir={out}", *extra]) == 0
    metrics = json.loads((out / "summary.json").read_text())["benchmarks"][benchmark]["metrics"]
    return metrics, [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_the_mislabeled_base_records_its_recipe_and_draws_the_named_shape_less_often_than_the_shipped_base(tmp_path):
    """shapeworld:sd3_mislabeled is configs/shapes/pretrain_sd3_mislabeled.yaml's model (continued from shapeworld:sd3
    with shape_noise 0.5): on the shape prompts (single object, colours; training prompts, held-out seeds) it is
    clearly worse than the shipped base (the error its GRPO recipe corrects), yet it still draws the named shape in at
    least a fifth of the images (a random model: none)."""
    assert _continued_base("sd3_mislabeled", "pretrain_sd3_mislabeled.yaml").data.shape_noise == 0.5
    recipe_file = SHAPES / "flow_grpo_mislabeled.yaml"
    assert load_config(recipe_file).model.pretrained == "shapeworld:sd3_mislabeled"
    results = {}
    for name, extra in (("mislabeled", []), ("shipped", ["model.pretrained=shapeworld:sd3"])):
        results[name], _ = _base_eval(recipe_file, "shapeworld@test:single_object+colors", tmp_path / name,
                                      "images_per_prompt=2", *extra)
    mislabeled, shipped = results["mislabeled"]["image_accuracy"], results["shipped"]["image_accuracy"]
    assert shipped >= 0.8 and 0.2 <= mislabeled <= shipped - 0.25, results


def test_the_faded_base_records_its_recipe_and_draws_images_the_detector_finds_no_shape_in(tmp_path):
    """shapeworld:sd3_faded is configs/shapes/pretrain_sd3_faded.yaml's model (continued from shapeworld:sd3 with
    half its images faded): on the single-object prompts, which name no colour, it draws washed-out images in which
    the ShapeWorld detector finds nothing (the error the embedded default corrects), the shipped base none; and it
    still draws the named shape in at least a third of them."""
    from PIL import Image

    from mmrl.rewards.shapeworld import detect

    assert _continued_base("sd3_faded", "pretrain_sd3_faded.yaml").data.faded == 0.5
    recipe_file = SHAPES / "flow_grpo_faded.yaml"
    assert load_config(recipe_file).model.pretrained == "shapeworld:sd3_faded"
    empty, right = {}, {}
    for name, extra in (("faded", []), ("shipped", ["model.pretrained=shapeworld:sd3"])):
        metrics, rows = _base_eval(recipe_file, "shapeworld@test:single_object", tmp_path / name,
                                   "images_per_prompt=8", *extra)
        assert len(rows) == 16
        empty[name] = sum(not detect(Image.open(tmp_path / name / row["image"])) for row in rows)
        right[name] = round(metrics["image_accuracy"] * 16)
    assert empty["shipped"] == 0 and empty["faded"] >= 3, empty
    assert right["shipped"] >= 12 and 6 <= right["faded"] <= right["shipped"] - 3, right


def test_the_shipped_vlm_base_loads_by_name_and_beats_a_random_model_on_held_out_videos(tmp_path):
    folder = base_model_path("qwen_vl")
    assert (folder / "config.json").is_file() and (folder / "mmrl_sft.yaml").is_file()
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 10 * 2 ** 20, f"the shipped base is {size / 2 ** 20:.1f} MiB"
    args = ["benchmarks=[temporal_grounding]", "data=shapeworld:heldout:24:temporal_grounding", "progress=false"]
    recipe = SHAPES / "vlm_video_tg_grpo.yaml"
    results = {}
    for name, extra in (("base", []), ("random", ["model.pretrained=tiny:qwen2_5_vl"])):
        assert main(["eval", str(recipe), "checkpoint=base", *args, f"output_dir={tmp_path / name}", *extra]) == 0
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        results[name] = summary["benchmarks"]["temporal_grounding"]["metrics"]
    assert results["random"]["miou"] <= 0.05
    assert results["base"]["miou"] >= 0.25 and results["base"]["r1@0.5"] >= 0.2, results


def test_the_shipped_grounding_base_records_its_recipe_and_localises_what_a_blind_or_random_model_cannot(tmp_path):
    import dataclasses

    import yaml
    from mmrl.sft import load_sft_config

    folder = base_model_path("qwen_vl_grounding")
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 12 * 2 ** 20, f"the shipped base is {size / 2 ** 20:.1f} MiB"
    shipped = yaml.safe_load((folder / "mmrl_sft.yaml").read_text())
    recipe = load_sft_config(SHAPES / "sft_qwen_vl_grounding.yaml")
    # the record loads as the recipe does (fields added since it was written take their defaults)
    assert dataclasses.asdict(load_sft_config(folder / "mmrl_sft.yaml")) == dataclasses.asdict(recipe)
    assert shipped["model"]["vision_position_std"] == recipe.model.vision_position_std == 2.0
    args = ["benchmarks=[rec]", "data=shapeworld:heldout:24:grounding", "progress=false"]
    grpo = SHAPES / "vlm_grounding_grpo.yaml"
    assert load_config(grpo).model.pretrained == "shapeworld:qwen_vl_grounding"
    results = {}
    for name, extra in (("base", ["blind=true"]), ("random", ["model.pretrained=tiny:qwen3_vl"])):
        assert main(["eval", str(grpo), "checkpoint=base", *args, f"output_dir={tmp_path / name}", *extra]) == 0
        results[name] = json.loads((tmp_path / name / "summary.json").read_text())["benchmarks"]["rec"]
    base, blind, random = (results["base"]["metrics"], results["base"]["blind"]["metrics"],
                           results["random"]["metrics"])
    assert random["miou"] <= 0.05
    assert base["acc@0.5"] >= 0.15 and base["miou"] >= 0.25, base
    assert base["miou"] >= blind["miou"] + 0.1 and base["acc@0.5"] > blind["acc@0.5"], (base, blind)


def test_the_shipped_loose_box_base_records_its_recipe_and_answers_boxes_larger_than_the_object(tmp_path):
    """shapeworld:qwen_vl_grounding_loose is its recipe's model (the record loads as the recipe does): it localises
    (mIoU above a random model's and its blind control's) with boxes about (1 + 2 * 0.25)^2 = 2.25 times the object's
    area, the bias its GRPO recipe's exact-box IoU reward corrects."""
    import dataclasses
    import statistics

    from mmrl.sft import load_sft_config

    folder = base_model_path("qwen_vl_grounding_loose")
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 12 * 2 ** 20, f"the shipped base is {size / 2 ** 20:.1f} MiB"
    recipe = load_sft_config(SHAPES / "sft_qwen_vl_grounding_loose.yaml")
    assert dataclasses.asdict(load_sft_config(folder / "mmrl_sft.yaml")) == dataclasses.asdict(recipe)
    grpo = SHAPES / "vlm_grounding_loose_grpo.yaml"
    out = tmp_path / "base"
    assert main(["eval", str(grpo), "checkpoint=base", "benchmarks=[rec]", "data=shapeworld:heldout:24:grounding",
                 "progress=false", f"output_dir={out}", "blind=true"]) == 0
    result = json.loads((out / "summary.json").read_text())["benchmarks"]["rec"]
    base, blind = result["metrics"], result["blind"]["metrics"]
    assert base["miou"] >= 0.25 and base["miou"] >= blind["miou"] + 0.1, (base, blind)
    ratios = []
    for line in (out / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        pred, target = sample["verdict"]["pred"], sample["target"]
        if sample["blind"] or pred is None:
            continue
        ratios.append((pred[2] - pred[0]) * (pred[3] - pred[1]) / ((target[2] - target[0]) * (target[3] - target[1])))
    assert len(ratios) >= 20 and statistics.median(ratios) > 1.5, ratios


@pytest.mark.parametrize("name", ["qwen_vl_timeline", "qwen_vl_timeline_loose"])
def test_the_shipped_timeline_bases_record_their_recipe_and_read_when_in_the_clip(name, tmp_path):
    """shapeworld:qwen_vl_timeline(_loose) is its recipe's model: greedy on held-out clips it walks through the
    prompt's timestamps and answers many different spans (the time-blind bases answer 1-5), its target's loss rises
    by a fifth or more when the clip's frames are reversed (the time-blind bases: at most 2 %), and the loose one
    answers spans about twice the event's length, the bias its GRPO recipe's exact-span rewards correct."""
    import dataclasses
    import importlib.util
    import statistics

    from mmrl.sft import load_sft_config

    folder = base_model_path(name)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 12 * 2 ** 20, f"the shipped base is {size / 2 ** 20:.1f} MiB"
    recipe = load_sft_config(SHAPES / f"sft_{name}.yaml")
    assert dataclasses.asdict(load_sft_config(folder / "mmrl_sft.yaml")) == dataclasses.asdict(recipe)
    grpo = SHAPES / f"vlm_video_{name[len('qwen_vl_'):]}_grpo.yaml"
    assert load_config(grpo).model.pretrained == f"shapeworld:{name}"
    out = tmp_path / "base"
    assert main(["eval", str(grpo), "checkpoint=base", "benchmarks=[temporal_grounding]",
                 "data=shapeworld:heldout:24:temporal_grounding", "progress=false", f"output_dir={out}"]) == 0
    metrics = json.loads((out / "summary.json").read_text())["benchmarks"]["temporal_grounding"]["metrics"]
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert metrics["miou"] >= 0.3 and metrics["num_unparseable"] <= 2, metrics
    assert sum("0.2 s " in r["answer"] and "5.5 s " in r["answer"] for r in rows) >= 20
    spans = [(tuple(r["verdict"]["pred"]), r["target"]) for r in rows if r["verdict"]["pred"]]
    assert len({pred for pred, _ in spans}) >= 8
    widths = statistics.median((p[1] - p[0]) / (t[1] - t[0]) for p, t in spans)
    assert (widths > 1.5) if name.endswith("_loose") else (0.7 < widths < 1.4), widths
    spec = importlib.util.spec_from_file_location("clip_dependence", REPO / "benchmarks" / "clip_dependence.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    data = f"shapeworld:heldout:16:{recipe.data.train.split(':')[-1]}"  # the clips with the base's own targets
    loss = probe.clip_dependence(str(grpo), data, limit=16)["loss"]
    assert loss["reversed"] > 1.2 * loss["clip"] and loss["other_clip"] > 1.5 * loss["clip"], loss


def test_the_loose_timeline_sft_recipe_is_the_timeline_recipe_on_loose_spans(tmp_path):
    """The two timeline SFT recipes differ only in their data; a few steps of the loose one from the shipped grounding
    base make a model that its GRPO recipe (exact spans, KL to the base) trains for an update."""
    from mmrl.sft import load_sft_config

    recipe, plain = (load_sft_config(SHAPES / f"sft_qwen_vl_timeline{v}.yaml") for v in ("_loose", ""))
    assert recipe.data.train == plain.data.train + "_loose" and recipe.data.eval == plain.data.eval + "_loose"
    assert (recipe.model, recipe.train, recipe.generation) == (plain.model, plain.train, plain.generation)
    assert plain.model.base == "shapeworld:qwen_vl_grounding" and plain.generation.video_fps == 2.0
    for grpo in ("vlm_video_timeline_grpo.yaml", "vlm_video_timeline_loose_grpo.yaml"):
        config = load_config(SHAPES / grpo)
        assert config.data.dataset.endswith(":temporal_grounding")  # exact spans: the rewards see the truth
        assert config.eval.options["data"].endswith(":temporal_grounding")
        assert {"temporal_iou", "hit"} <= set(config.rewards)
        assert config.generation.max_new_tokens == plain.generation.max_new_tokens
        assert config.algorithm.beta == 0.04  # KL to the base: the loose recipe's figures need it (README)
    sft = tmp_path / "sft"
    assert main(["sft", str(SHAPES / "sft_qwen_vl_timeline_loose.yaml"), f"output_dir={sft}", "train.steps=2",
                 "train.batch_size=2", "data.train=shapeworld:train:4:temporal_grounding_timeline_loose",
                 "data.eval=shapeworld:heldout:2:temporal_grounding_timeline_loose", "eval.every=0",
                 "logging.save_every=2"]) == 0
    run = tmp_path / "run"
    assert main(["train", str(SHAPES / "vlm_video_timeline_loose_grpo.yaml"), f"output_dir={run}",
                 f"model.pretrained={sft / 'model'}", "data.dataset=shapeworld:train:4:temporal_grounding",
                 "train.steps=1", "data.prompts_per_step=1", "data.group_size=2", "train.batch_size=2",
                 "logging.eval_every=0", "logging.progress_bar=false", "logging.tensorboard=false", "eval.every=0",
                 "generation.max_new_tokens=24"]) == 0
    row = metrics_rows(run)[-1]
    assert row["step"] == 1 and row["samples/nan_reward"] == 0.0 and "reward/hit" in row


@pytest.mark.parametrize("recipe, base, dataset", [
    ("vlm_grounding_grpo.yaml", "shapeworld:qwen_vl_grounding", "shapeworld:train:4:grounding"),
    ("vlm_grounding_loose_grpo.yaml", "shapeworld:qwen_vl_grounding_loose", "shapeworld:train:4:grounding"),
    ("vlm_video_tg_grpo.yaml", "shapeworld:qwen_vl", "shapeworld:train:4:temporal_grounding"),
    ("vlm_video_timeline_grpo.yaml", "shapeworld:qwen_vl_timeline", "shapeworld:train:4:temporal_grounding"),
    ("vlm_video_timeline_loose_grpo.yaml", "shapeworld:qwen_vl_timeline_loose",
     "shapeworld:train:4:temporal_grounding"),
])
def test_one_update_of_each_vlm_shapes_recipe_on_the_shipped_base(recipe, base, dataset, tmp_path):
    config = load_config(SHAPES / recipe)
    assert config.model.pretrained == base and config.data.dataset.startswith("shapeworld:train:")
    run = tmp_path / "run"
    assert main(["train", str(SHAPES / recipe), f"output_dir={run}", f"data.dataset={dataset}", "train.steps=1",
                 "data.prompts_per_step=1", "data.group_size=2", "train.batch_size=2", "logging.eval_every=0",
                 "logging.progress_bar=false", "logging.tensorboard=false", "eval.every=0",
                 "generation.max_new_tokens=16"]) == 0
    row = metrics_rows(run)[-1]
    assert row["step"] == 1 and row["samples/nan_reward"] == 0.0
    assert (run / "checkpoints" / "step_1" / "trainable.safetensors").is_file()


def test_the_loose_box_sft_recipe_feeds_its_grpo_recipe_whose_rewards_score_the_exact_box(tmp_path):
    """configs/shapes/sft_qwen_vl_grounding_loose.yaml (the grounding base's model, taught loose boxes) makes the model
    configs/shapes/vlm_grounding_loose_grpo.yaml trains; its GRPO data and benchmark are the exact-box grounding
    lines, so the IoU reward sees what the annotations hid."""
    from mmrl.sft import load_sft_config

    sft_recipe, grpo = SHAPES / "sft_qwen_vl_grounding_loose.yaml", SHAPES / "vlm_grounding_loose_grpo.yaml"
    recipe, plain = load_sft_config(sft_recipe), load_sft_config(SHAPES / "sft_qwen_vl_grounding.yaml")
    assert recipe.data.train == plain.data.train.replace(":grounding", ":grounding_loose")
    assert (recipe.model, recipe.train) == (plain.model, plain.train)  # the same model and steps, only the targets
    config = load_config(grpo)
    assert config.model.pretrained == "shapeworld:qwen_vl_grounding_loose"
    assert config.data.dataset.endswith(":grounding") and config.eval.options["data"].endswith(":grounding")
    assert {"iou", "hit"} <= set(config.rewards)
    sft = tmp_path / "sft"
    assert main(["sft", str(sft_recipe), f"output_dir={sft}", "train.steps=2", "train.batch_size=2",
                 "data.train=shapeworld:train:4:grounding_loose", "data.eval=shapeworld:heldout:2:grounding_loose",
                 "eval.every=0", "logging.save_every=2"]) == 0
    run = tmp_path / "run"
    assert main(["train", str(grpo), f"output_dir={run}", f"model.pretrained={sft / 'model'}",
                 "data.dataset=shapeworld:train:4:grounding", "train.steps=1", "data.prompts_per_step=1",
                 "data.group_size=2", "train.batch_size=2", "logging.eval_every=0", "logging.progress_bar=false",
                 "logging.tensorboard=false", "eval.every=0", "generation.max_new_tokens=24"]) == 0
    row = metrics_rows(run)[-1]
    assert row["step"] == 1 and row["samples/nan_reward"] == 0.0 and "reward/hit" in row


def test_the_crop_trace_sft_recipe_feeds_the_tool_grpo_recipe_under_each_credit_rule(tmp_path):
    """configs/shapes/sft_qwen_vl_grounding_crop.yaml (tool-call traces, from the shipped grounding base) makes the
    model configs/shapes/vlm_grounding_crop_grpo.yaml trains with tools, under outcome, TACO and factorized credit."""
    from mmrl.sft import load_sft_config

    sft_recipe, grpo = SHAPES / "sft_qwen_vl_grounding_crop.yaml", SHAPES / "vlm_grounding_crop_grpo.yaml"
    recipe = load_sft_config(sft_recipe)
    assert recipe.model.base == "shapeworld:qwen_vl_grounding" and recipe.generation.tools == ["crop"]
    assert recipe.data.train.endswith(":grounding_crop")
    config = load_config(grpo)
    assert config.model.pretrained == f"{load_sft_config(sft_recipe).output_dir}/model"
    assert config.generation.tools == ["crop"] and "crop_recall" in config.rewards
    sft = tmp_path / "sft"
    assert main(["sft", str(sft_recipe), f"output_dir={sft}", "train.steps=2", "train.batch_size=2",
                 "data.train=shapeworld:train:4:grounding_crop", "data.eval=shapeworld:heldout:2:grounding_crop",
                 "eval.every=0", "logging.save_every=2"]) == 0
    credit = ["[]", "[{name: taco, accuracy: hit}]", "[{name: factorized, vision: [crop_recall]}]"]
    for k, variants in enumerate(credit):
        run = tmp_path / f"run{k}"
        assert main(["train", str(grpo), f"output_dir={run}", f"model.pretrained={sft / 'model'}",
                     "data.dataset=shapeworld:train:4:grounding_crop", f"algorithm.variants={variants}",
                     "train.steps=1", "data.prompts_per_step=1", "data.group_size=2", "train.batch_size=2",
                     "logging.eval_every=0", "logging.progress_bar=false", "logging.tensorboard=false", "eval.every=0",
                     "generation.max_new_tokens=24"]) == 0
        row = metrics_rows(run)[-1]
        assert row["step"] == 1 and row["samples/nan_reward"] == 0.0 and "completions/tool_calls" in row
