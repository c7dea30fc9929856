"""``mmrl score``: a folder of images against prompts, with weightless rewards."""
import csv
import json
import math

import pytest
import torch
from fixtures import truncate_file, write_garbage, write_gradient_image, write_image, write_jsonl
from PIL import Image

from mmrl.cli import main
from mmrl.rewards import build_rewards
from mmrl.rewards.async_scoring import AsyncScorer
from mmrl.score import load_records, run_score

REWARDS = "{brightness: 1.0, jpeg_compressibility: {weight: 0.01}}"


@pytest.fixture
def folder(tmp_path):
    images = tmp_path / "images"
    write_image(images / "red.png", colour=(200, 30, 30))
    write_image(images / "dark.png", 40, 30, colour=(10, 10, 10))
    write_gradient_image(images / "sub" / "grad.png")
    write_image(images / "half.png", mode="RGBA")
    write_garbage(images / "garbage.png")
    write_gradient_image(images / "cut.png", 96, 96)
    truncate_file(images / "cut.png", fraction=0.3)
    return images


def expected(images_dir, names):
    reward = build_rewards({"brightness": 1.0, "jpeg_compressibility": {"weight": 0.01}})
    pils = [Image.open(images_dir / n).convert("RGB") for n in names]
    return reward(pils, ["x"] * len(pils))


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_score_csv_prompts_to_csv(folder, tmp_path, caplog):
    prompts = tmp_path / "prompts.csv"
    prompts.write_text("image,prompt,style\nred.png,a red square,flat\nmissing.png,nothing,\n"
                       "sub/grad.png,\"a gradient, smooth\",soft\ngarbage.png,junk,\ndark.png,a dark one,\n"
                       "cut.png,cut off,\nhalf.png,transparent,\n")
    out = tmp_path / "scores.csv"
    assert main(["score", "--rewards", REWARDS, "--images", str(folder), "--prompts", str(prompts),
                 "--out", str(out), "--batch-size", "2", "--quiet"]) == 0
    rows = read_csv(out)
    assert [r["image"] for r in rows] == ["red.png", "missing.png", "sub/grad.png", "garbage.png", "dark.png",
                                         "cut.png", "half.png"]
    assert rows[2]["prompt"] == "a gradient, smooth"
    assert list(rows[0]) == ["image", "prompt", "brightness", "jpeg_compressibility",
                             "jpeg_compressibility/jpeg_size_kb", "total", "error"]
    good = ["red.png", "sub/grad.png", "dark.png", "half.png"]
    ref = expected(folder, good)
    by_name = {r["image"]: r for r in rows}
    for i, name in enumerate(good):
        for key in ("brightness", "jpeg_compressibility", "total"):
            assert float(by_name[name][key]) == pytest.approx(ref[key][i].item(), rel=1e-6, abs=1e-7)
        assert by_name[name]["error"] == ""
    for name, words in [("missing.png", "missing image file"), ("garbage.png", "cannot read image"),
                        ("cut.png", "cannot read image")]:
        assert math.isnan(float(by_name[name]["total"])) and math.isnan(float(by_name[name]["brightness"]))
        assert words in by_name[name]["error"]


def test_score_jsonl_prompts_to_json_with_summary(folder, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"image": "red.png", "prompt": "a red square", "tag": 1},
        {"image": str(folder / "dark.png"), "prompt": "absolute path", "metadata": {"k": "v"}},
        {"image": "nope.jpg", "prompt": "missing"},
    ])
    out = tmp_path / "out" / "scores.json"
    summary = run_score(None, REWARDS, str(folder), str(prompts), str(out), batch_size=8, quiet=True)
    data = json.loads(out.read_text())
    assert data["summary"]["num_images"] == 3 and data["summary"]["num_unreadable"] == 1
    assert data["summary"]["num_scored"] == 2 == summary["num_scored"]
    rows = data["rows"]
    assert rows[2]["total"] is None and rows[2]["brightness"] is None and "missing" in rows[2]["error"]
    ref = expected(folder, ["red.png", "dark.png"])
    assert rows[0]["total"] == pytest.approx(ref["total"][0].item(), rel=1e-6)
    assert rows[1]["brightness"] == pytest.approx(ref["brightness"][1].item(), rel=1e-6)


def test_metadata_reaches_the_rewards(folder, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"image": "red.png", "prompt": "p", "answer": "A", "metadata": {"x": 1}}])
    records = load_records(prompts, folder)
    assert records[0].metadata == {"answer": "A", "x": 1}
    csv_prompts = tmp_path / "p.csv"
    csv_prompts.write_text("image,prompt,answer\nred.png,p,B\n")
    assert load_records(csv_prompts, folder)[0].metadata == {"answer": "B"}


def test_score_without_prompts_from_config(folder, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("rewards:\n  brightness: 1.0\n")
    out = tmp_path / "s.jsonl"
    assert main(["score", "--config", str(config), "--images", str(folder), "--out", str(out), "--quiet"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["image"] for r in rows] == ["cut.png", "dark.png", "garbage.png", "half.png", "red.png"]  # sorted
    assert sum(r["total"] is None for r in rows) == 2
    out2 = tmp_path / "r.csv"
    assert main(["score", "--config", str(config), "--images", str(folder), "--out", str(out2), "--recursive",
                 "--quiet"]) == 0
    assert "sub/grad.png" in [r["image"] for r in read_csv(out2)]
    # one decoding thread: the same rows (the next batch is gathered by a thread of its own; gathered in the decoding
    # pool it waited on its own decodes forever), in batches of 2 so that a next batch is prefetched
    out3 = tmp_path / "one.jsonl"
    assert main(["score", "--config", str(config), "--images", str(folder), "--out", str(out3), "--workers", "1",
                 "--batch-size", "2", "--quiet"]) == 0
    assert [json.loads(line) for line in out3.read_text().splitlines()] == rows
    # a run folder names its config.yaml (it said "config file not found" of the existing folder)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config.read_text())
    out4 = tmp_path / "run.jsonl"
    assert main(["score", "--config", str(run), "--images", str(folder), "--out", str(out4), "--quiet"]) == 0
    assert [json.loads(line) for line in out4.read_text().splitlines()] == rows


def test_score_input_errors_are_clear(folder, tmp_path, capsys):
    def run(*args):
        code = main(["score", *args])
        return code, capsys.readouterr().err

    bad_header = tmp_path / "bad.csv"
    bad_header.write_text("file,text\nred.png,x\n")
    code, err = run("--rewards", REWARDS, "--images", str(folder), "--prompts", str(bad_header), "--out", "o.csv")
    assert code == 2 and "image and prompt" in err
    code, err = run("--rewards", REWARDS, "--images", str(tmp_path / "nowhere"), "--out", "o.csv")
    assert code == 2 and "not a directory" in err
    code, err = run("--rewards", "{pickscor: 1}", "--images", str(folder), "--out", str(tmp_path / "o.csv"))
    assert code == 2 and "pickscore" in err  # nearest name
    code, err = run("--rewards", REWARDS, "--images", str(folder), "--out", str(tmp_path / "o.txt"))
    assert code == 2 and ".csv, .json or .jsonl" in err
    code, err = run("--rewards", REWARDS, "--images", str(folder), "--out", str(tmp_path / "o.csv"), "--workers", "0")
    assert code == 2 and "--workers must be >= 1, got 0" in err
    code, err = run("--images", str(folder), "--out", str(tmp_path / "o.csv"))
    assert code == 2 and "exactly one of" in err
    code, err = run("--config", str(tmp_path / "absent.yaml"), "--images", str(folder), "--out", "o.csv")
    assert code == 2 and "not found" in err
    bad_json = write_jsonl(tmp_path / "b.jsonl", ["{oops"])
    code, err = run("--rewards", REWARDS, "--images", str(folder), "--prompts", str(bad_json), "--out", "o.csv")
    assert code == 2 and "line 1" in err


def test_prompt_rewards_need_prompts_and_text_rewards_are_refused(folder, tmp_path, capsys):
    from mmrl.score import ScoreError, list_images, score_records

    reward = build_rewards({"brightness": 1.0})
    reward.needs_prompts = True  # as PickScore's composition would say
    with pytest.raises(ScoreError, match="need a prompt"):
        score_records(reward, list_images(folder))
    code = main(["score", "--rewards", "{think_answer_format: 1}", "--images", str(folder), "--out",
                 str(tmp_path / "o.csv"), "--quiet"])
    assert code == 2 and "judge text" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# AsyncScorer (the trainer's overlap of scoring with sampling)
# --------------------------------------------------------------------------------------------


def test_async_scorer_matches_sync_and_keeps_order():
    reward = build_rewards({"brightness": 1.0, "jpeg_incompressibility": 0.1})
    batches = [torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with AsyncScorer(reward) as scorer:
        futures = [scorer.submit(x, ["p"] * 3) for x in batches]
        results = [f.result(timeout=30) for f in futures]
    for x, result in zip(batches, results):
        local = reward(x, ["p"] * 3)
        assert result.keys() == local.keys()
        for key in local:
            torch.testing.assert_close(result[key], local[key])
        assert result.info["total"]["num_samples"] == 3 and result.seconds >= 0


def test_async_scorer_overlaps_and_propagates_errors():
    import threading
    import time

    started = threading.Event()

    def slow(images, prompts, metadata=None):
        started.set()
        time.sleep(0.3)
        return {"slow": torch.zeros(len(images))}

    scorer = AsyncScorer(slow)
    t0 = time.monotonic()
    future = scorer.submit(torch.zeros(2, 3, 4, 4))
    assert time.monotonic() - t0 < 0.2  # submit returns at once
    assert started.wait(5)
    assert scorer.pending == 1
    future.result(timeout=5)

    def broken(images, prompts, metadata=None):
        raise ValueError("bad batch")

    bad = AsyncScorer(broken).submit(torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="bad batch"):
        bad.result(timeout=5)
    scorer.close()
    with pytest.raises(RuntimeError, match="closed"):
        scorer.submit(torch.zeros(1, 3, 4, 4))


def test_async_scorer_copy_protects_against_in_place_edits():
    import threading

    gate = threading.Event()

    def gated(images, prompts, metadata=None):
        gate.wait(5)
        return {"m": images.mean(dim=(1, 2, 3))}

    with AsyncScorer(gated) as scorer:
        x = torch.ones(2, 3, 4, 4)
        future = scorer.submit(x, copy=True)
        x.zero_()
        gate.set()
        assert torch.equal(future.result(timeout=5)["m"], torch.ones(2))


def test_async_scorer_release_ends_its_worker_thread_and_restarts_on_submit():
    """The trainer releases the scorer after each rollout: a live worker that ran torch ops keeps an OpenMP team and
    slows every op of the training that follows (issue 12); an ended one does not."""
    import threading

    others = set(threading.enumerate())  # other tests' scorers may still hold threads

    def workers():
        return [t for t in threading.enumerate() if t.name.startswith("mmrl-reward") and t not in others]

    def torch_reward(images, prompts, metadata=None):
        return {"m": (images * 2 + 1).mean(dim=(1, 2, 3))}

    scorer = AsyncScorer(torch_reward)
    assert workers() == []  # nothing starts before the first submit
    first = scorer.submit(torch.ones(2, 3, 4, 4))
    assert torch.equal(first.result(timeout=5)["m"], torch.full((2,), 3.0))
    assert len(workers()) == 1
    scorer.release()
    assert workers() == []  # ended, not parked
    again = scorer.submit(torch.zeros(1, 3, 4, 4))  # a new worker for the next rollout
    assert torch.equal(again.result(timeout=5)["m"], torch.ones(1))
    scorer.close()
    assert workers() == []


def test_overlap_scoring_auto_is_on_for_accelerators_only():
    from mmrl.build import overlap_scoring_on
    from mmrl.config import ConfigError, load_config

    def config(value):
        return load_config(None, [f"train.overlap_scoring={value}"])

    assert load_config(None, []).train.overlap_scoring == "auto"
    assert overlap_scoring_on(config("auto"), torch.device("cpu")) is False
    assert overlap_scoring_on(config("auto"), torch.device("cuda", 0)) is True
    assert overlap_scoring_on(config("true"), torch.device("cpu")) is True
    assert overlap_scoring_on(config("false"), torch.device("cuda", 0)) is False
    for bad in ("sometimes", "1"):
        with pytest.raises(ConfigError, match="overlap_scoring"):
            config(bad)


def test_json_errors_name_the_column_once(folder, tmp_path, capsys):
    for text, words in (('{"image": "red.png", "prompt": "unterminated', "Unterminated string starting at column"),
                        ('{"image": "red.png", "prompt": "tab\there"}', "Invalid control character at column"),
                        ("{oops", "Expecting property name enclosed in double quotes at column 2")):
        bad = write_jsonl(tmp_path / "b.jsonl", [text])
        code = main(["score", "--rewards", REWARDS, "--images", str(folder), "--prompts", str(bad), "--out",
                     str(tmp_path / "o.csv")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"mmrl: error: {bad}, line 1: not valid JSON (") and words in err, err
        assert "at at" not in err and err.count("\n") == 1
    assert not (tmp_path / "o.csv").exists()


def test_a_dead_remote_reward_is_one_error_before_any_image_is_read(folder, tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "o.csv"
    code = main(["score", "--rewards", f"{{remote: {{kwargs: {{url: 'http://127.0.0.1:{port}', retries: 0}}}}}}",
                 "--images", str(folder), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"mmrl: error: rewards.remote: reward server http://127.0.0.1:{port}/health failed")
    assert not out.exists()
