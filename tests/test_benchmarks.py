"""benchmarks/vlm_grpo_vs_trl.py: a smoke run of the mmrl-vs-TRL GRPO benchmark (skipped without TRL).

Not a performance test: it checks that both frameworks run the same step workload (completions, optimizer
steps, prompt token ids, trainable parameters, language-model forwards) and that the vision-encoder counts
show the difference the benchmark is about (mmrl: one image per prompt per step; TRL: one per completion per
forward).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "vlm_grpo_vs_trl.py"


def test_vlm_grpo_bench_without_its_peer_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    """Without TRL the comparison cannot run: one JSON line with the reason, exit code 0, and nothing written (it
    exited 1 with no JSON line)."""
    import builtins

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import vlm_grpo_vs_trl as bench

    real = builtins.__import__

    def no_trl(name, *args, **kwargs):
        if name == "trl":
            raise ImportError("No module named 'trl'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_trl)
    out = tmp_path / "bench.json"
    assert bench.main(["--steps", "1", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and not out.exists()
    line = json.loads(lines[0])
    assert line["bench"] == "vlm-grpo" and line["ok"] is True and "TRL is not installed" in line["skipped"]


@pytest.mark.parametrize("train_vision", [False, True])
def test_vlm_grpo_vs_trl_smoke(tmp_path, train_vision):
    pytest.importorskip("trl")
    out = tmp_path / "bench.json"
    prompts, group, batch, epochs = 1, 2, 2, 2
    cmd = [sys.executable, str(SCRIPT), "--steps", "1", "--prompts", str(prompts), "--group", str(group),
           "--batch-size", str(batch), "--inner-epochs", str(epochs), "--max-new-tokens", "4", "--out", str(out),
           *(["--train-vision"] if train_vision else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workload_problems"] == []
    assert report["versions"]["trl"]
    assert report["settings"]["minibatch_order"]["mmrl"].startswith("groups")  # the VLM default, as run
    n = prompts * group
    mmrl, trl = report["mmrl"], report["trl"]
    assert mmrl["optimizer_steps_per_step"] == trl["optimizer_steps_per_step"] == epochs * n // batch
    assert report["workload_checks"]["prompt_token_ids_identical_samples"] > 0
    # the same language-model calls (generation: prefill + decode, old log-probs, training forwards) less mmrl's
    # old-log-prob forward of the first optimizer step's minibatch, whose training forward gives them; but each of
    # mmrl's training forwards is two calls (model.share_prompt_prefix: the minibatch's one distinct prompt, then its
    # completions on that prompt's KV cache), with fewer token positions than TRL's full rows
    trained = epochs * n // batch
    cm, ct = mmrl["counts_per_step"], trl["counts_per_step"]
    assert ct["lm_grad_calls"] == trained and cm["lm_grad_calls"] == 2 * trained
    # and generation prefills the prompt once (one more call, the group's rows then start from its cache)
    assert cm["lm_calls"] == ct["lm_calls"] - 1 + trained + 1
    prompt_tokens, completion_tokens = max(mmrl["prompt_lengths"]), 4  # one prompt; padded completion width
    assert ct["lm_grad_tokens"] == trained * batch * (prompt_tokens + completion_tokens)
    assert cm["lm_grad_tokens"] == trained * (prompt_tokens + batch * completion_tokens)
    # vision: mmrl encodes each prompt's image once; TRL once per completion in generation, old log-probs and
    # every training forward
    assert trl["counts_per_step"]["vision_images"] == n * (2 + epochs)
    if train_vision:  # a trained vision tower is run again in every training forward (its features carry gradients)
        assert prompts < mmrl["counts_per_step"]["vision_images"] <= trl["counts_per_step"]["vision_images"]
    else:
        assert mmrl["counts_per_step"]["vision_images"] == prompts
    assert report["ratio_steps_per_s_mmrl_over_trl"] > 0
    # one more step of each under the tensor tracker: at least the step's logits (rows x kept positions x vocab)
    for side in (mmrl, trl):
        assert side["peak_step_mib_per_sample"] * 2**20 >= 4 * 640, side["peak_step_mib_per_sample"]
    assert report["ratio_peak_step_memory_per_sample_trl_over_mmrl"] == pytest.approx(
        trl["peak_step_mib_per_sample"] / mmrl["peak_step_mib_per_sample"])
    # the tiny Qwen2.5-VL: 156,224 language-model parameters; the vision tower adds to them when trained too
    assert (mmrl["trainable_params"] > 156_224) == train_vision and mmrl["trainable_params"] == trl["trainable_params"]


def test_flow_grpo_bench_same_work_through_mmrl_bench(tmp_path):
    """`mmrl bench flow-grpo`: one JSON line; mmrl and the plain loop put the same rows through the transformer
    (sampling without grad, training with it; mmrl in one training call, the loop in one per trained step) and make
    the same optimizer steps; the compute floor replays mmrl's calls."""
    out = tmp_path / "flow.json"
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", "bench", "flow-grpo", "--steps", "1", "--warmup", "0",
                           "--cfg", "on", "--prompts", "1", "--group", "2", "--num-steps", "4", "--threads", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text()) and line["bench"] == "flow-grpo" and line["ok"] is True
    work = line["results"]["cfg"]["work"]
    n, trained = 2, 3  # 1 prompt x 2 images; 4 steps, int(4 * 0.99) = 3 trained
    for side in ("mmrl", "plain"):
        assert work[side]["rows"] == {"no_grad": n * 4 * 2, "grad": n * trained * 2}  # x2: the CFG halves
        assert work[side]["images"] == n and work[side]["optimizer_steps"] == 1
    assert work["mmrl"]["calls"]["grad"] == 1 and work["plain"]["calls"]["grad"] == trained
    assert line["results"]["cfg"]["floor_s"] > 0 and line["mmrl_over_floor"]["cfg"] > 0
    peak = line["peak_step_mib_per_image"]["cfg"]
    assert set(peak) == {"mmrl", "plain", "floor"}  # the floor: the replay of the untimed update's calls
    assert all(mib * 2**20 >= 16 * 4 * 4 for mib in peak.values()), peak  # at least one 4 x 4 latent per image
    assert "no --flow-grpo" in line["flow_grpo_skipped"] and "speedup_vs_flow_grpo" not in line


def test_overhead_bench_replays_the_trainers_model_work(tmp_path):
    """`mmrl bench overhead --family vlm`: the floor replays exactly the calls one update made (one generate of
    the group's tokens; per minibatch of the 2 inner epochs one training forward, plus the old and reference
    log-prob passes of the first epoch, the first minibatch's old log-probs from its training forward) and the
    quotient is reported."""
    out = tmp_path / "overhead.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MMRL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", "bench", "overhead", "--family", "vlm", "--steps", "1",
                           "--warmup", "0", "--hidden", "128", "--layers", "2", "--max-new-tokens", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text()) and line["bench"] == "overhead" and line["ok"] is True
    vlm = line["results"]["vlm"]
    assert vlm["generate_calls"] == 1 and vlm["new_tokens"] == [4]  # 2 prompts x 4 completions in one call
    assert vlm["shared_prefills"] == 1  # its 2 prompts prefilled once, the 8 rows started from their cache
    # tiny recipe: batch 4 of 8 samples, 2 inner epochs: 4 training forwards; reference passes 2, old log-prob
    # passes 1 (the first minibatch's come from its training forward); every minibatch of 4 repeats one of the 2
    # prompts, so each pass runs its distinct prompts once first (model.share_prompt_prefix) and the floor replays that
    assert vlm["forwards"] == {"grad": 4, "no_grad": 3, "shared_prompt_forwards": 7}
    assert vlm["floor_s"] > 0 and vlm["mmrl_over_floor"] > 0
    peak = vlm["peak_step_mib_per_sample"]  # an untimed update and its replay under the tensor tracker
    assert set(peak) == {"mmrl", "floor"} and peak["mmrl"] > 0 and peak["floor"] > 0
    assert line["peak_step_mib_per_sample"]["vlm"] == {k: round(v, 3) for k, v in peak.items()}


def test_mmrl_bench_names_and_errors(capsys):
    from mmrl.cli import BENCHES, benchmarks_dir, main

    assert all((benchmarks_dir() / script).is_file() for script in BENCHES.values())
    assert main(["bench", "--help"]) == 0 and "flow-grpo" in capsys.readouterr().out
    assert main(["bench", "flow-grp"]) == 2
    assert "unknown benchmark 'flow-grp'; did you mean 'flow-grpo'?" in capsys.readouterr().err


def test_rewards_bench_scores_alike_and_reports_memory(tmp_path):
    """`benchmarks/reward_throughput.py`: the batched scorer and the per-image loop give the same scores (the JPEG
    reward at DDPO's scale, which the loop computes), and each side's peak tensor memory per image is measured."""
    out = tmp_path / "rewards.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.with_name("reward_throughput.py")), "--images", "4", "--size",
                           "32", "--group", "2", "--repeats", "1", "--only", "brightness", "jpeg_compressibility",
                           "--no-remote", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["reward"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"brightness", "jpeg_compressibility"}
    assert rows["jpeg_compressibility"]["max_abs_score_diff"] == 0.0  # the same encoder, the same -kB
    assert rows["brightness"]["max_abs_score_diff"] < 1e-2  # the loop's uint8 quantisation only
    one_image = 3 * 32 * 32 / 2**20  # MiB of one image as uint8: every side converts at least that
    for row in rows.values():
        assert row["mmrl_peak_mib_per_image"] >= one_image and row["loop_peak_mib_per_image"] >= one_image, row


def test_prompt_sharing_bench_compares_the_two_layouts_on_the_same_minibatch(tmp_path):
    """`mmrl bench prompt-sharing`: the policy's own log-prob passes with each distinct prompt once and with full
    rows, on the same rollout and minibatches: the same log-probs (to float rounding), fewer token positions through
    the language model with sharing (2 prompts x 4 completions in a minibatch of 8: 2 prompt rows + 8 completions)."""
    out = tmp_path / "sharing.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MMRL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", "bench", "prompt-sharing", "--hidden", "128", "--layers",
                           "2", "--group", "4", "--batch", "8", "--max-new-tokens", "4", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text()) and line["bench"] == "prompt-sharing" and line["ok"] is True
    assert line["max_abs_logp_difference"] < 1e-4
    assert line["distinct_prompts_per_round"] == [2]  # the minibatch of 8 is the whole rollout: both prompts
    prompt, width = line["prompt_tokens"], line["completion_width"]
    tokens = line["lm_token_positions"]
    assert tokens["full_rows/grad"] == tokens["full_rows/no_grad"] == 8 * (prompt + width)
    assert tokens["shared/grad"] == tokens["shared/no_grad"] == 2 * prompt + 8 * width
    assert line["speedup_grad"] > 0 and set(line["peak_mib_per_sample"]) == {"shared", "full_rows"}


def test_vllm_rollout_bench(tmp_path):
    """`mmrl bench vllm-rollout`: HF generate and the vLLM engine on the same prompts and weights, alternated; without
    vLLM the line says why and the exit code is 0."""
    from mmrl.pipelines.vlm.vllm_engine import vllm_missing

    out = tmp_path / "vllm.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MMRL_CACHE": str(tmp_path / "cache"),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mmrl.cli", "bench", "vllm-rollout", "--hidden", "128", "--layers",
                           "2", "--group", "4", "--max-new-tokens", "8", "--repeats", "1", "--out", str(out),
                           "--set", "generation.vllm={enforce_eager: true, max_num_batched_tokens: 2048}"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["bench"] == "vllm-rollout" and line["ok"] is True
    missing = vllm_missing()
    if missing:  # nothing written: a committed result from a machine with vLLM stays
        assert line["skipped"] == missing and not out.exists()
        return
    assert line == json.loads(out.read_text())
    assert line["tokens"]["hf"] and line["tokens"]["vllm"] and line["speedup_rollout"] > 0
    assert line["sampler_logp_gap"]["max"] < 5e-3 and line["push_s_median"] is not None


def test_vlm_grpo_vs_trl_on_a_sized_model(tmp_path):
    """``--hidden``: both sides train the same random Qwen2.5-VL of that width (head size 64, the shape ``--vllm``
    needs), built once by the parent."""
    pytest.importorskip("trl")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(SCRIPT), "--steps", "1", "--prompts", "1", "--group", "2", "--batch-size", "2",
           "--inner-epochs", "1", "--max-new-tokens", "4", "--hidden", "128", "--layers", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workload_problems"] == []
    assert report["settings"]["model"] == "random Qwen2.5-VL, decoder 128 x 1"
    assert report["settings"]["engine"] == "HF generate"
    # the tiny model's language model has 156,224 trainable parameters; this one is larger, and the same on both
    assert report["mmrl"]["trainable_params"] == report["trl"]["trainable_params"] > 156_224


def test_vlm_grpo_vs_trl_rejects_layers_without_a_sized_model():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give --hidden too" in proc.stderr


def test_grounding_grid_draws_each_evaluations_box_and_the_exact_one(tmp_path):
    """benchmarks/grounding_grid.py: one row per evaluation folder, the exact box in cyan and each row's predicted box
    in its colour at the pixels the samples name (2x), and a clear stop when the folders scored different lines."""
    from PIL import Image

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import grounding_grid
    finally:
        sys.path.remove(str(SCRIPT.parent))
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    Image.new("RGB", (40, 40), (30, 30, 30)).save(data / "images" / "0.png")

    def folder(name, pred, ident="a"):
        out = tmp_path / name
        out.mkdir()
        hit = 1.0 if pred == [10, 10, 20, 20] else 0.0
        rec = {"metrics": {"acc@0.5": hit}, "protocol": {"data_file": str(data / "x.jsonl")}}
        (out / "summary.json").write_text(json.dumps({"mmrl_eval": 1, "checkpoint": {"path": "base"},
                                                      "benchmarks": {"rec": rec}}))
        row = {"benchmark": "rec", "id": ident, "image": "images/0.png", "target": [10, 10, 20, 20],
               "scores": {"acc@0.5": hit}, "verdict": {"pred": pred}}
        (out / "samples.jsonl").write_text(json.dumps(row) + "\n")
        return out

    base, trained = folder("base", [2, 2, 30, 30]), folder("trained", [10, 10, 20, 20])
    picture = grounding_grid.grid([base, trained], ["base", "trained"], count=1)
    tile = 80 + 4
    assert picture.size == (150 + tile, 2 * tile)
    assert picture.getpixel((150 + 4, 40)) == (255, 64, 64)  # the base's box, x = 2 * 2
    assert picture.getpixel((150 + 20, 30)) == (0, 255, 255)  # the exact box on the base's row, x = 10 * 2
    assert picture.getpixel((150 + 20, tile + 30)) == (64, 224, 64)  # the trained box drawn over the exact one
    assert picture.getpixel((150 + 4, tile + 40)) == (30, 30, 30)
    with pytest.raises(SystemExit, match="same lines"):
        grounding_grid.grid([base, folder("other", None, ident="b")], ["base", "other"], count=1)


def test_grounding_grid_charts_temporal_spans_under_the_clips_frames(tmp_path):
    """benchmarks/grounding_grid.py on temporal_grounding folders: the frames at the first frame of each temporal step
    (6 of a 24-frame 4 fps clip read at 2 fps), the exact span in cyan and each evaluation's span in its colour, on a
    time axis as wide as the strip; the command picks the chart from the folders' benchmark."""
    from mmrl.data.shapeworld import Obj, Scene, write_video

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import grounding_grid
    finally:
        sys.path.remove(str(SCRIPT.parent))
    data = tmp_path / "data"
    scenes = [Scene((Obj("square", "red" if f < 12 else "blue", (10, 10, 30, 30)),), 56) for f in range(24)]
    write_video(data / "videos" / "0.mp4", scenes)

    def folder(name, pred):
        out = tmp_path / name
        out.mkdir()
        result = {"metrics": {"r1@0.5": 0.5}, "protocol": {"data_file": str(data / "x.jsonl")}}
        (out / "summary.json").write_text(json.dumps({"mmrl_eval": 1, "checkpoint": {"path": "base"},
                                                      "benchmarks": {"temporal_grounding": result}}))
        row = {"benchmark": "temporal_grounding", "id": "clip-00000", "video": "videos/0.mp4", "target": [3.0, 6.0],
               "scores": {"r1@0.5": 0.0}, "verdict": {"pred": pred}}
        (out / "samples.jsonl").write_text(json.dumps(row) + "\n")
        return out

    base, trained = folder("base", [0.0, 3.0]), folder("trained", None)
    assert grounding_grid.benchmark_of(base) == "temporal_grounding"
    picture = grounding_grid.span_grid([base, trained], ["base", "trained"], count=1, tile=20, bar=8)
    assert picture.size == (150 + 6 * 20, 2 * 18 + 20 + 3 * 10 + 6)
    top = 2 * 18
    red, blue = picture.getpixel((150 + 10, top + 10)), picture.getpixel((150 + 5 * 20 + 10, top + 10))
    assert red[0] > 150 > red[2] and blue[2] > 150 > blue[0]  # frame 0 red, frame 21 blue
    truth, base_bar, none_bar = (top + 20 + 2 + b * 10 + 4 for b in range(3))
    assert picture.getpixel((150 + 30, truth)) == (40, 40, 40) and picture.getpixel((150 + 90, truth)) == (0, 255, 255)
    assert picture.getpixel((150 + 30, base_bar)) == (255, 64, 64)
    assert picture.getpixel((150 + 90, base_bar)) == (40, 40, 40)
    assert picture.getpixel((150 + 30, none_bar)) == (40, 40, 40)  # no parseable span: no bar
    out = tmp_path / "chart.png"
    assert grounding_grid.main([str(base), str(trained), "--count", "1", "--out", str(out)]) == 0
    assert out.is_file()
