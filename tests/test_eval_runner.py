"""``mmrl eval`` for generation benchmarks (mmrl.eval.runner, mmrl.eval.protocol): end to end on a tiny SD3 with
tiny random scorers (GenEval's detector and CLIP, PickScore) and rapidocr with its real weights, every output file,
the checkpoint's EMA weights, determinism, resume (after a larger limit and after a kill), the pinned protocol and
its overrides, NaN scores with reasons, and the one-line errors for bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fixtures import one_error, tiny_clip, tiny_flow_config, tiny_mask2former
import yaml
from PIL import Image

import mmrl.build
import mmrl.eval.benchmarks
from mmrl.cli import main
from mmrl.config import load_config
from mmrl.eval.protocol import DEFAULTS, PINNED_SHA256, file_sha256, resolve_protocol
from mmrl.eval.runner import (EvalError, GenEvalScorer, OCRScorer, _resolve_checkpoint, load_prompt_set,
                              parse_eval_args, weights_sha256)
from mmrl.pipelines.flow.policy import FlowPolicy
from mmrl.rewards.ocr import OCRReward

FAST = ["resolution=32", "num_steps=2"]  # 32 px, 2 ODE steps: the tiny model in milliseconds per image
REPO_CONFIG = mmrl.eval.benchmarks.assets_dir().parent.parent / "configs/tiny/flow_grpo.yaml"




def rows_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def summary_of(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def pixels(path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    """The tiny CPU recipe on a tiny SD3 built here."""
    return tiny_flow_config(tmp_path_factory.mktemp("eval-model"))


@pytest.fixture(scope="module")
def run(config_file):
    """A run folder (config.yaml + checkpoints/step_3 with live and EMA weights that differ from the base) and the
    policy with the EMA weights loaded."""
    from mmrl.checkpoint import load_trainable, save_checkpoint

    config = load_config(config_file)
    run_dir = config_file.parent / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config_file.read_text())
    policy = mmrl.build.build_policy(config)
    g = torch.Generator().manual_seed(1)
    params = policy.named_trainable_parameters()
    live = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    ema = {n: p.detach() + 0.03 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    save_checkpoint(run_dir / "checkpoints", 3, trainable=live, state={"update": 3}, objects={"ema": {"shadow": ema}})
    load_trainable(policy.named_trainable_parameters(), ema, "ema")
    return run_dir, policy, ema


def tiny_clip_dir(directory):
    model, processor = tiny_clip(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def tiny_mask2former_dir(directory):
    from mmrl.rewards.geneval import GENEVAL_CLASSES

    names = [{"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}.get(n, n)
             for n in GENEVAL_CLASSES]
    model, processor = tiny_mask2former(names)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    """Folders of a tiny random Mask2Former (GenEval's detector) and a tiny random CLIP (GenEval's colours, PickScore),
    and a prompt file whose second prompt has no quoted text (the OCR reward cannot judge it)."""
    base = tmp_path_factory.mktemp("eval-scorers")
    detector = tiny_mask2former_dir(base / "det")
    clip = tiny_clip_dir(base / "clip")
    prompts = base / "prompts.txt"
    prompts.write_text('a shop sign that says "open"\na red apple on a table\n')
    return {"detector": detector, "clip": clip, "prompts": prompts}


def e2e_args(run_dir, scorers, out) -> list[str]:
    clip = scorers["clip"]
    return ["eval", str(run_dir), "benchmarks=[ocr,geneval,reward:pickscore+ocr,reward:brightness@partiprompts]",
            "limit=2", "images_per_prompt=2", *FAST, f"detector={scorers['detector']}", f"clip_model={clip}",
            f"prompts={scorers['prompts']}", f"reward_kwargs={{pickscore: {{model: {clip}, processor: {clip}, "
            f"device: cpu}}}}", f"output_dir={out}"]


@pytest.fixture(scope="module")
def e2e(run, scorers, tmp_path_factory):
    """Every benchmark of this slice, from a run folder (its latest checkpoint, EMA weights), written to `out`."""
    run_dir, _, _ = run
    out = tmp_path_factory.mktemp("eval-e2e") / "out"
    assert main(e2e_args(run_dir, scorers, out)) == 0
    return out


@pytest.fixture
def count_calls(monkeypatch):
    """Counts FlowPolicy.sample_eval calls (the prompts drawn) and rapidocr recognitions."""
    calls = {"sample_eval": [], "ocr": 0}
    sample_eval, recognize = FlowPolicy.sample_eval, OCRReward.recognize

    def counted_sample(self, prompts, seeds, **kwargs):
        calls["sample_eval"].append((list(prompts), list(seeds)))
        return sample_eval(self, prompts, seeds, **kwargs)

    def counted_recognize(self, image):
        calls["ocr"] += 1
        return recognize(self, image)

    monkeypatch.setattr(FlowPolicy, "sample_eval", counted_sample)
    monkeypatch.setattr(OCRReward, "recognize", counted_recognize)
    return calls


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a policy is built: the error must be found before any model loads."""
    monkeypatch.setattr(mmrl.build, "build_policy", lambda *a, **k: pytest.fail("a model was loaded"))


def ocr_args(config_file, out, limit) -> list[str]:
    return ["eval", str(config_file), "checkpoint=base", "benchmarks=[ocr]", f"limit={limit}", *FAST,
            f"output_dir={out}"]


@pytest.fixture(scope="module")
def straight_ocr(config_file, tmp_path_factory):
    """OCR on the first 4 prompts of the base model in one go: what every resumed evaluation must equal."""
    out = tmp_path_factory.mktemp("eval-straight") / "out"
    assert main(ocr_args(config_file, out, 4)) == 0
    return out


# ---------------------------------------------------------------------------------------------- end to end


def test_end_to_end_writes_every_file(e2e, run, scorers):
    run_dir, _, ema = run
    names = ["ocr", "geneval", "reward:pickscore+ocr", "reward:brightness@partiprompts"]
    folders = ["ocr", "geneval", "reward-pickscore+ocr", "reward-brightness@partiprompts"]
    assert sorted(p.name for p in e2e.iterdir()) == ["grids", "images", "protocol.json", "report.html",
                                                     "report_files", "samples.jsonl", "summary.json"]
    rows = rows_of(e2e)
    assert [(r["benchmark"], r["prompt_index"], r["image_index"]) for r in rows] == [
        (b, i, k) for b in names for i in range(2) for k in range(2)]
    for folder in folders:
        assert sorted(p.name for p in (e2e / "images" / folder).iterdir()) == [
            "00000_0.png", "00000_1.png", "00001_0.png", "00001_1.png"]
        assert Image.open(e2e / "grids" / f"{folder}.png").size == (2 * 32, 2 * 32)  # 2 prompts x 2 images
    for r in rows:
        assert r["seed"] == 42 + r["image_index"] and (e2e / r["image"]).is_file()
        assert set(r) >= {"benchmark", "prompt_index", "image_index", "prompt", "seed", "image", "scores", "verdict",
                          "reason", "protocol", "generator"}
    ocr = [r for r in rows if r["benchmark"] == "ocr"]
    assert ocr[0]["verdict"]["target"] == "Spring Collection 2024" and isinstance(ocr[0]["verdict"]["recognized"], str)
    geneval = [r for r in rows if r["benchmark"] == "geneval"]
    assert all(r["scores"]["correct"] in (0.0, 1.0) and isinstance(r["verdict"]["clauses"], list) for r in geneval)
    assert geneval[0]["prompt"] == "a photo of a bench"

    summary = summary_of(e2e)
    assert summary["checkpoint"] == {"path": str(run_dir / "checkpoints" / "step_3"), "run_dir": str(run_dir),
                                     "ema": True, "weights_sha256": weights_sha256(ema)}
    assert set(summary["packages"]) >= {"torch", "diffusers", "transformers", "mmrl", "rapidocr"}
    assert summary["config"]["model"]["family"] == "sd3" and summary["device"] == "cpu"
    b = summary["benchmarks"]
    assert list(b) == names and all(b[n]["num_images"] == 4 for n in names)
    assert b["ocr"]["metrics"]["n"] == 4 and 0 <= b["ocr"]["metrics"]["accuracy"] <= 1
    g = b["geneval"]["metrics"]
    assert g["num_images"] == 4 and g["num_prompts"] == 2 and set(g["per_tag"]) == {"single_object"}
    assert "two_object" in g["missing_tags"] and g["overall"] == g["per_tag"]["single_object"]
    assert b["geneval"]["grid"] == "grids/geneval.png"
    parti = b["reward:brightness@partiprompts"]["metrics"]
    assert parti["brightness"]["n"] == 4 and set(parti["per_category"]["brightness"]) <= {
        "Abstract", "Animals", "Artifacts", "World Knowledge"}


def test_a_scorer_that_cannot_judge_gives_nan_with_its_reason_counted(e2e):
    rows = [r for r in rows_of(e2e) if r["benchmark"] == "reward:pickscore+ocr"]
    judged, unjudged = rows[:2], rows[2:]  # prompt 1 ("a red apple ...") has no quoted text
    assert all(isinstance(r["scores"]["pickscore"], float) for r in rows)  # PickScore judges every image
    assert all(isinstance(r["scores"]["ocr"], float) and r["reason"] is None for r in judged)
    for r in unjudged:
        assert r["scores"]["ocr"] is None and r["reason"].startswith("ocr: no quoted target text in the prompt")
    assert '"ocr": null' in (e2e / "samples.jsonl").read_text()  # NaN is null: strict JSON
    result = summary_of(e2e)["benchmarks"]["reward:pickscore+ocr"]
    assert result["num_unjudged"] == 2 and list(result["unjudged_reasons"].values()) == [2]
    assert result["metrics"]["ocr"]["num_unjudged"] == 2 and result["metrics"]["ocr"]["n"] == 2
    assert result["metrics"]["pickscore"]["n"] == 4 and result["metrics"]["pickscore"]["num_unjudged"] == 0


def test_ocr_scores_are_rapidocr_on_the_saved_pngs(e2e):
    from mmrl.eval.scoring import ocr_benchmark
    from mmrl.rewards import build_reward

    rows = [r for r in rows_of(e2e) if r["benchmark"] == "ocr"]
    reward = build_reward("ocr")  # rapidocr with the PP-OCR weights of its wheel
    images = [Image.open(e2e / r["image"]).convert("RGB") for r in rows]
    direct = reward(images, [r["prompt"] for r in rows])["ocr"].tolist()
    assert [r["scores"]["ocr_accuracy"] for r in rows] == direct
    assert [r["verdict"]["recognized"] for r in rows] == reward.last_info["recognized"]
    assert summary_of(e2e)["benchmarks"]["ocr"]["metrics"] == ocr_benchmark(direct)


def test_ocr_scorer_reads_rendered_text_with_the_real_weights():
    from PIL import ImageDraw, ImageFont

    from mmrl.eval.runner import EvalItem

    image = Image.new("RGB", (256, 96), "white")
    ImageDraw.Draw(image).text((10, 20), "OPEN NOW", fill="black", font=ImageFont.load_default(size=40))
    scorer = OCRScorer()
    scorer.build()
    exact = scorer.score([image], EvalItem(0, 'a sign that says "open now"', target="open now"))[0]
    assert exact == {"scores": {"ocr_accuracy": 1.0}, "verdict": {"target": "open now", "recognized": "OPEN NOW"},
                     "reason": None}
    close = scorer.score([image], EvalItem(1, 'a sign that says "open noon"', target="open noon"))[0]
    assert close["scores"]["ocr_accuracy"] == pytest.approx(1 - 2 / 8)  # "opennow" vs "opennoon": 2 edits of 8

    def broken(image):
        raise RuntimeError("onnx session died")

    scorer.reward.engine = broken
    failed = scorer.score([image], EvalItem(2, 'a sign that says "x"', target="x"))[0]
    assert failed["scores"] == {"ocr_accuracy": None}
    assert failed["reason"] == "OCR engine failed: RuntimeError: onnx session died"


def test_images_are_the_checkpoints_ema_weights_each_reproducible_on_its_own(e2e, run):
    from mmrl.tracking import make_grid_image

    _, policy, _ = run  # the EMA weights loaded
    row = [r for r in rows_of(e2e) if r["benchmark"] == "ocr"][3]  # prompt 1, image 1: seed 43
    image = policy.sample_eval([row["prompt"]], [43], num_steps=2)[0]
    assert np.array_equal(np.asarray(make_grid_image(image[None], rows=1)), pixels(e2e / row["image"]))


def test_the_protocols_guidance_reaches_the_sampler(config_file, straight_ocr, tmp_path):
    from mmrl.tracking import make_grid_image

    out = tmp_path / "out"
    assert main([*ocr_args(config_file, out, 1), "guidance=1.0"]) == 0  # the config says 4.5: CFG off here
    no_cfg = mmrl.build.build_policy(load_config(config_file, ["sampling.guidance_scale=1.0"]))
    prompt = rows_of(out)[0]["prompt"]
    expected = np.asarray(make_grid_image(no_cfg.sample_eval([prompt], [42], num_steps=2)[0][None], rows=1))
    assert np.array_equal(pixels(out / "images/ocr/00000_0.png"), expected)
    assert not np.array_equal(pixels(straight_ocr / "images/ocr/00000_0.png"), expected)  # 4.5: another image
    assert summary_of(out)["benchmarks"]["ocr"]["protocol"]["overridden"]["guidance_scale"] == {"default": 4.5,
                                                                                               "used": 1.0}
    # a config trained without CFG (guidance 1.0) is evaluated with the protocol's CFG 4.5
    data = yaml.safe_load(config_file.read_text())
    data["sampling"]["guidance_scale"] = 1.0
    (tmp_path / "no_cfg.yaml").write_text(yaml.safe_dump(data))
    assert main([*ocr_args(tmp_path / "no_cfg.yaml", tmp_path / "cfg", 1)]) == 0
    first = "images/ocr/00000_0.png"
    assert np.array_equal(pixels(tmp_path / "cfg" / first), pixels(straight_ocr / first))


def test_a_resolution_the_model_cannot_generate_is_one_line(config_file, capsys, tmp_path):
    # the tiny SD3's positional embedding covers 128 px; a protocol at 512 (GenEval's, the reward sets') must say
    # so and how to fix it, not fail inside diffusers' cropped_pos_embed
    args = [a for a in ocr_args(config_file, tmp_path / "out", 1) if not a.startswith("resolution=")]
    assert main([*args, "resolution=512"]) == 2
    err = capsys.readouterr().err
    assert "resolution 512 is larger than this SD3 model can generate" in err and "resolution=" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "images").exists()


def test_the_same_checkpoint_and_protocol_give_the_same_images_and_numbers(e2e, run, scorers, tmp_path):
    run_dir, _, _ = run
    again = tmp_path / "again"
    assert main(e2e_args(run_dir, scorers, again)) == 0
    assert rows_of(again) == rows_of(e2e)
    assert summary_of(again) == summary_of(e2e)
    for path in sorted((e2e / "images").rglob("*.png")):
        assert path.read_bytes() == (again / path.relative_to(e2e)).read_bytes(), path  # bitwise on the CPU


def test_a_checkpoint_named_by_its_folder_name_is_the_runs_own(run):
    """checkpoint=step_3 said "no such run or checkpoint folder" unless given as a full path."""
    run_dir, _, _ = run
    options = parse_eval_args(["checkpoint=step_3"])[0]
    assert _resolve_checkpoint(options, run_dir).path == run_dir / "checkpoints" / "step_3"
    with pytest.raises(EvalError, match="checkpoint=step_9: no such run or checkpoint folder"):
        _resolve_checkpoint(parse_eval_args(["checkpoint=step_9"])[0], run_dir)


def test_a_config_evaluates_its_runs_latest_checkpoint_by_default(config_file, run, capsys):
    run_dir, _, ema = run
    args = ["eval", str(config_file), "benchmarks=[reward:brightness@drawbench]", "limit=1", "images_per_prompt=1",
            *FAST]
    assert main(args) == 0  # the config's output_dir is the run: its latest checkpoint, EMA weights
    out = run_dir / "eval" / "step_3"
    assert f"checkpoint {run_dir / 'checkpoints' / 'step_3'} (EMA weights) -> {out}" in capsys.readouterr().out
    summary = summary_of(out)
    assert summary["checkpoint"]["ema"] is True and summary["checkpoint"]["weights_sha256"] == weights_sha256(ema)
    assert rows_of(out)[0]["prompt"] == load_prompt_set("drawbench")[0][0].prompt
    assert main([*args, "ema=false"]) == 0  # the live weights, into their own folder
    live = summary_of(run_dir / "eval" / "step_3-no_ema")["checkpoint"]
    from safetensors.torch import load_file

    assert live["ema"] is False
    trainable = load_file(str(run_dir / "checkpoints/step_3/trainable.safetensors"))
    assert live["weights_sha256"] == weights_sha256(trainable)


# ---------------------------------------------------------------------------------------------- resume


def test_resume_with_a_larger_limit_generates_only_the_new_prompts(config_file, straight_ocr, count_calls, tmp_path):
    out = tmp_path / "out"
    assert main(ocr_args(config_file, out, 2)) == 0
    assert len(count_calls["sample_eval"]) == 2 and count_calls["ocr"] == 2
    first = rows_of(out)
    assert main(ocr_args(config_file, out, 4)) == 0
    new = count_calls["sample_eval"][2:]
    prompts = [item.prompt for item in load_prompt_set("ocr")[0][:4]]
    assert new == [([prompts[2]], [42]), ([prompts[3]], [42])]  # only the new prompts, one image per call
    assert count_calls["ocr"] == 4  # the first two images were not scored again
    assert rows_of(out)[:2] == first
    assert rows_of(out) == rows_of(straight_ocr)
    assert summary_of(out) == summary_of(straight_ocr)


def test_a_killed_eval_continues_where_it_stopped(config_file, straight_ocr, count_calls, monkeypatch, tmp_path,
                                                  capsys):
    out = tmp_path / "out"
    counted = FlowPolicy.sample_eval

    def killed_on_the_third(self, prompts, seeds, **kwargs):
        if len(count_calls["sample_eval"]) == 2:
            raise KeyboardInterrupt
        return counted(self, prompts, seeds, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(FlowPolicy, "sample_eval", killed_on_the_third)
        assert main(ocr_args(config_file, out, 4)) == 130
    assert "mmrl: interrupted" in capsys.readouterr().err
    assert len(rows_of(out)) == 2 and not (out / "summary.json").exists()
    with open(out / "samples.jsonl", "a") as handle:  # a row cut short by the kill
        handle.write('{"benchmark": "ocr", "prompt_ind')
    assert main(ocr_args(config_file, out, 4)) == 0
    assert [p for p, _ in count_calls["sample_eval"][2:]] == [[item.prompt] for item in load_prompt_set("ocr")[0][2:4]]
    assert rows_of(out) == rows_of(straight_ocr)
    assert summary_of(out) == summary_of(straight_ocr)


def test_another_protocol_or_model_in_the_same_output_dir_is_one_line(straight_ocr, config_file, run, capsys, no_model,
                                                                     tmp_path):
    import shutil

    run_dir, _, _ = run
    out = tmp_path / "out"
    shutil.copytree(straight_ocr, out)
    before = (out / "samples.jsonl").read_bytes()
    assert main(["eval", str(config_file), "checkpoint=base", "benchmarks=[ocr]", "limit=4", "resolution=32",
                 "num_steps=3", f"output_dir={out}"]) == 2
    one_error(capsys, "holds ocr images made under another protocol", "num_steps: 2 -> 3", "another output_dir=")
    assert main(["eval", str(config_file), f"checkpoint={run_dir}", "benchmarks=[ocr]", "limit=4", *FAST,
                 f"output_dir={out}"]) == 2
    one_error(capsys, "holds an evaluation of another model or checkpoint", "weights_sha256: None -> ")
    assert (out / "samples.jsonl").read_bytes() == before
    assert main(ocr_args(config_file, out, 3)) == 0  # a smaller limit: the summary of the first 3, no model loaded
    assert summary_of(out)["benchmarks"]["ocr"]["num_images"] == 3


# ---------------------------------------------------------------------------------------------- the protocol


def test_protocol_defaults_are_the_official_ones_and_pinned():
    ocr_items, ocr_path, pinned = load_prompt_set("ocr")
    assert len(ocr_items) == 1018 and pinned == PINNED_SHA256["ocr/test.txt"] == file_sha256(ocr_path)
    scorer = OCRScorer()
    ocr = resolve_protocol("ocr", "ocr", prompts_file=ocr_path, pinned_sha256=pinned, total_prompts=1018,
                           scorer=scorer.name, scorer_version=scorer.version, scorer_settings=scorer.settings)
    assert (ocr.images_per_prompt, ocr.seed, ocr.resolution, ocr.num_steps, ocr.guidance_scale) == (1, 42, 512, 40, 4.5)
    assert ocr.num_prompts == 1018 and ocr.overridden == {} and "general_ocr_sd3" in ocr.source
    assert "rapidocr" in ocr.scorer_version and ocr.seeds() == [42]

    items, path, pinned = load_prompt_set("geneval")
    scorer = GenEvalScorer(None, None)
    common = dict(prompts_file=path, pinned_sha256=pinned, total_prompts=len(items), scorer=scorer.name,
                  scorer_version=scorer.version, scorer_settings=scorer.settings, scorer_defaults=scorer.defaults)
    geneval = resolve_protocol("geneval", "geneval", **common)
    assert len(items) == 553 and (geneval.images_per_prompt, geneval.seed) == (4, 42)
    assert geneval.seeds() == [42, 43, 44, 45]
    assert geneval.scorer_settings["detector"] == "facebook/mask2former-swin-small-coco-instance"
    assert DEFAULTS["drawbench"].images_per_prompt == 5

    mine = resolve_protocol("geneval", "geneval", **common, limit=10,
                            user={"num_steps": 20, "guidance": 4.5, "images_per_prompt": 2, "seed": None})
    assert mine.overridden == {"num_steps": {"default": 40, "used": 20}, "images_per_prompt": {"default": 4, "used": 2},
                               "num_prompts": {"default": 553, "used": 10}}  # guidance 4.5 is the default
    assert mine.hash() != geneval.hash()  # the steps decide the images
    fewer = resolve_protocol("geneval", "geneval", **common, limit=3, user={"num_steps": 20})
    assert fewer.hash() == mine.hash()  # how many prompts and images: not the protocol of one image
    flux = resolve_protocol("geneval", "geneval", **common, family="flux", config_guidance=3.5)
    assert flux.guidance_scale == 3.5 and "distilled guidance" in flux.source and flux.overridden == {}


def test_the_protocol_and_its_overrides_are_recorded(e2e, scorers):
    summary = summary_of(e2e)
    ocr = summary["benchmarks"]["ocr"]["protocol"]
    assert (ocr["images_per_prompt"], ocr["seed"], ocr["resolution"], ocr["num_steps"], ocr["guidance_scale"]) == \
        (2, 42, 32, 2, 4.5)
    assert ocr["overridden"] == {"images_per_prompt": {"default": 1, "used": 2},
                                 "resolution": {"default": 512, "used": 32}, "num_steps": {"default": 40, "used": 2},
                                 "num_prompts": {"default": 1018, "used": 2}}
    assert ocr["prompts_sha256"] == ocr["pinned_sha256"] == PINNED_SHA256["ocr/test.txt"]
    assert ocr["seed_rule"].startswith("seed of image k") and len(ocr["hash"]) == 64
    geneval = summary["benchmarks"]["geneval"]["protocol"]
    assert geneval["overridden"]["images_per_prompt"] == {"default": 4, "used": 2}
    assert geneval["overridden"]["scorer_settings.detector"]["used"] == str(scorers["detector"])
    user_file = summary["benchmarks"]["reward:pickscore+ocr"]["protocol"]
    assert user_file["pinned_sha256"] is None and user_file["prompts_sha256"] == file_sha256(scorers["prompts"])
    assert user_file["scorer"] == "reward:pickscore+ocr"
    recorded = json.loads((e2e / "protocol.json").read_text())
    assert recorded["benchmarks"]["ocr"] == ocr and recorded["generator"] == summary["generator"]
    assert summary["eval_keys"]["limit"] == 2 and "output_dir" not in summary["eval_keys"]


# ---------------------------------------------------------------------------------------------- bad input


VLM = REPO_CONFIG.parent / "vlm_grounding.yaml"


@pytest.mark.parametrize("extra,words", [
    (["benchmarks=[reward:brightness]", "prompts=missing.txt"], ["prompt file not found: missing.txt"]),
    (["benchmarks=[genevel]"], ["unknown benchmark 'genevel'", "did you mean 'geneval'"]),
    (["dpg_csv=dpg_bench.csv"], ["dpg_csv= is for the dpg_bench benchmark(s), none of which is requested"]),
    (["benchmarks=[reward:pickscore]"], ["needs prompts", "@drawbench", "prompts=FILE"]),
    (["benchmarks=[reward:brightness@coco]"], ["unknown prompt set 'coco'"]),
    (["benchmarks=[reward:nosuch@drawbench]"], ["unknown reward 'nosuch'"]),
    (["limt=3"], ["unknown eval key 'limt'", "did you mean 'limit'", "valid eval keys: checkpoint, benchmarks"]),
    (["limit=0"], ["limit=0: expected an integer >= 1"]),
    (["resolution=40"], ["resolution=40: must be a multiple of 16"]),
    (["model.resolution=64"], ["model.resolution is set by the evaluation protocol", "resolution="]),
    (["checkpoint=nowhere"], ["checkpoint=nowhere: no such run or checkpoint folder"]),
    (["model.nope=1"], ["model.nope"]),
])
def test_bad_input_is_one_line_before_any_model_loads(extra, words, config_file, capsys, no_model, tmp_path,
                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = [] if any(e.startswith("benchmarks=") for e in extra) else ["benchmarks=[ocr]"]
    assert main(["eval", str(config_file), *default, *extra, f"output_dir={tmp_path / 'out'}"]) == 2
    one_error(capsys, *words)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_vlm_config_gets_the_vlm_evaluation(capsys, no_model, tmp_path):
    # model.family qwen_vl goes to mmrl.eval.vlm (tested in tests/test_eval_vlm.py), with its own keys
    assert main(["eval", str(VLM), "resolution=64", f"output_dir={tmp_path / 'out'}"]) == 2
    one_error(capsys, "'resolution' is for image-generation policies", "model.family: qwen_vl")
    assert main(["eval", "checkpoint=base"]) == 2
    one_error(capsys, "a CONFIG is required")


def test_a_missing_or_altered_shipped_benchmark_file_is_one_line(config_file, capsys, no_model, tmp_path, monkeypatch):
    assets = tmp_path / "assets"
    (assets / "ocr").mkdir(parents=True)
    monkeypatch.setattr(mmrl.eval.benchmarks, "assets_dir", lambda: assets)
    args = ["eval", str(config_file), "benchmarks=[ocr]", f"output_dir={tmp_path / 'out'}"]
    assert main(args) == 2
    one_error(capsys, "OCR prompt file not found", str(assets / "ocr" / "test.txt"))
    (assets / "ocr" / "test.txt").write_text('a sign that says "hello"\n')
    assert main(args) == 2
    one_error(capsys, "not the version of the ocr file mmrl pins", "sha256")
    assert not (tmp_path / "out").exists()


def test_base_results_go_to_the_run_folder_named_not_the_configs_output_dir(tmp_path):
    """A copied run with no checkpoint: `mmrl eval COPY` writes COPY/eval/base, not into the folder its config.yaml
    names as output_dir (the original run's); a config file alone still writes under its output_dir."""
    from types import SimpleNamespace

    from mmrl.eval.runner import _Checkpoint, default_output_dir

    options, cfg = SimpleNamespace(output_dir=None, ema=True), SimpleNamespace(output_dir=str(tmp_path / "original"))
    base = _Checkpoint(None, None)
    assert default_output_dir(options, base, cfg, tmp_path / "copy") == tmp_path / "copy" / "eval" / "base"
    assert default_output_dir(options, base, cfg) == tmp_path / "original" / "eval" / "base"


def test_a_seed_torch_cannot_take_is_one_eval_error():
    """seed=2**64 reached torch.Generator.manual_seed ("Overflow when unpacking long long") after the model loaded;
    a sample's seed is the base plus its index, so the base stays below 2**62, for flow and VLM evaluations."""
    from mmrl.eval.runner import EvalError, parse_eval_args
    from mmrl.eval.vlm import parse_vlm_eval_args

    assert parse_eval_args(["seed=7"])[0].seed == 7
    for parse in (parse_eval_args, parse_vlm_eval_args):
        with pytest.raises(EvalError, match=r"seed=99999999999999999999: must be below 2\*\*62"):
            parse(["seed=99999999999999999999"])
