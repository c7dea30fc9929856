"""The ``mmrl`` command line: one-line errors (exit code 2) found before any model loads, free argument order,
``--version`` / ``python -m mmrl``, ``mmrl sample`` for image and VLM runs, reward-server probes, Ctrl-C, quiet
library loading, the tiny-model cache under concurrency, and the credit-curves benchmark's output folder."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from PIL import Image

import mmrl.build
import mmrl.cli
from mmrl.cli import main
from mmrl.config import Config, config_to_dict
from fixtures import TINY_RECIPE, one_error

REPO = Path(__file__).parents[1]
VLM_CONFIG = REPO / "configs/tiny/vlm_grounding.yaml"
GPU_CONFIG = REPO / "configs/gpu/qwen25vl3b_rec_grpo.yaml"  # names data files this machine does not have
TINY = ["sampling.num_steps=4", "sampling.eval_num_steps=4", "sampling.max_sequence_length=16",
        "data.prompts_per_step=2", "data.group_size=2", "train.batch_size=2", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.eval_every=0"]
VLM_FAST = ["train.steps=1", "logging.progress_bar=false", "logging.tensorboard=false", "logging.eval_every=0",
            "generation.max_new_tokens=6"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A shared MMRL_CACHE for the tiny models and data sets of this module."""
    path = tmp_path_factory.mktemp("mmrl-cache")
    saved = os.environ.get("MMRL_CACHE")
    os.environ["MMRL_CACHE"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("MMRL_CACHE", None)
    else:
        os.environ["MMRL_CACHE"] = saved


@pytest.fixture(scope="module")
def flow_run(cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("flow") / "run"
    assert main(["train", TINY_RECIPE, f"output_dir={run}", "train.steps=1", *TINY]) == 0
    return run


@pytest.fixture(scope="module")
def vlm_run(cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("vlm") / "run"
    assert main(["train", str(VLM_CONFIG), f"output_dir={run}", *VLM_FAST]) == 0
    return run


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a policy is built: the error must be found before any model is loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the error was found")

    monkeypatch.setattr(mmrl.build, "build_policy", refuse)




def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------- errors, parsing


@pytest.mark.parametrize("argv,words", [
    (["train", "train.stpes=3"], ["did you mean 'train.steps'"]),
    (["train", "optim.lr=0"], ["optim.lr must be > 0"]),
    (["train", "model.lora_rank=0"], ["model.lora_rank must be >= 1"]),
    (["train", "train.steps=["], ["override 'train.steps=['", "not valid YAML (line 1, column 2"]),
    (["train", "missing.yaml"], ["config file not found: missing.yaml"]),
    (["config", "validate"], ["a CONFIG path is required"]),
    (["config", "frobnicate"], ["invalid choice: 'frobnicate'", "mmrl config --help"]),
    (["config", "validate", str(GPU_CONFIG)], ["data.dataset: file not found", "--no-check-files"]),
    (["sample"], ["required: run"]),
    ([], ["required: COMMAND"]),
    (["nonsense"], ["invalid choice: 'nonsense'"]),
])
def test_mistakes_are_one_line_and_exit_code_2(argv, words, capsys, no_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    one_error(capsys, *words)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_bad_yaml_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    assert main(["config", "validate", str(bad)]) == 2
    line = one_error(capsys, f"{bad}: not valid YAML: line 2, column 1:")
    assert "at at" not in line


def test_help_fields_print_yaml_that_parses_back_to_the_defaults(capsys):
    assert main(["config", "show", "--help-fields"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out) == config_to_dict(Config())
    header = " ".join(line.lstrip("# ") for line in out.splitlines() if line.startswith("#"))
    assert "Keys a config file leaves out take these defaults" in header
    assert "SD3.5-Medium / Flow-GRPO GPU settings, NOT the CPU run" in header
    assert "resolution: 512  #" in out and "revision: null  #" in out and "use_lora: true  #" in out


def test_options_and_positionals_in_any_order(capsys):
    for argv in (["config", "validate", "--no-check-files", str(GPU_CONFIG)],
                 ["config", "validate", str(GPU_CONFIG), "--no-check-files", "train.steps=3"],
                 ["config", "validate", str(GPU_CONFIG), "train.steps=3", "--no-check-files"]):
        assert main(argv) == 0, argv
        assert capsys.readouterr().out.strip() == f"{GPU_CONFIG}: ok (files not checked)"
    assert main(["config", "show", "--help-fields", str(VLM_CONFIG), "train.steps=9"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"]["family"] == "qwen_vl" and shown["train"]["steps"] == 9
    assert main(["config", "show", str(VLM_CONFIG), "--no-check-files", "train.steps=5"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["steps"] == 5


def test_validate_checks_every_data_line_and_lists_the_problems(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a cat"}\n{"prompt": 3}\n{"prompt": "cut\n')
    flow = str(REPO / "configs/tiny/flow_grpo.yaml")
    assert main(["config", "validate", "--quick", flow, f"data.prompts={bad}"]) == 2
    head, *listing = capsys.readouterr().err.strip().splitlines()
    assert head.startswith(f"mmrl: error: {bad}: 2 problem(s) in 2 of 3 line(s)")
    assert listing == [f"  {bad}:2: expected an object with a string 'prompt' field, got 'prompt' of type int",
                       f"  {bad}:3: not valid JSON (Unterminated string starting at column 12)"]
    import mmrl.data.validate

    seen = []
    real = mmrl.data.validate.check_data
    monkeypatch.setattr(mmrl.data.validate, "check_data", lambda config, *, media=True: seen.append(media) or
                        real(config, media=media))
    assert main(["config", "validate", str(VLM_CONFIG), "--quick"]) == 0
    assert main(["config", "validate", str(VLM_CONFIG)]) == 0
    assert seen == [False, True]
    assert capsys.readouterr().out.startswith(f"{VLM_CONFIG}: ok; data: tiny:grounding")
    assert main(["config", "validate", "--quick", "--no-check-files", str(VLM_CONFIG)]) == 2
    one_error(capsys, "--quick goes with `mmrl config validate` (without --no-check-files)")


def test_config_validate_checks_the_eval_section_as_train_does(capsys):
    # validate said ok for benchmarks and eval options that `mmrl train` then refused at startup
    flow = str(REPO / "configs/tiny/flow_grpo.yaml")
    assert main(["config", "validate", flow, "eval.every=1", "eval.benchmarks=[foo]"]) == 2
    one_error(capsys, "eval: unknown benchmark 'foo'")
    assert main(["config", "validate", flow, "eval.every=1", "eval.benchmarks=[ocr]", "eval.options={limt: 3}"]) == 2
    one_error(capsys, "eval: unknown eval key 'limt'; did you mean 'limit'?")
    assert main(["config", "validate", str(REPO / "configs/shapes/flow_grpo_faded.yaml")]) == 0
    assert ": ok; data:" in capsys.readouterr().out


def test_config_validate_reads_pretrain_and_sft_configs_by_their_own_schema(capsys):
    """`mmrl config validate` on an `mmrl pretrain` / `mmrl sft` config validates it with that command's schema
    (their keys are not `mmrl train`'s), and a mistake in one is that schema's one-line error."""
    from mmrl.cli import config_command_of

    shapes = REPO / "configs" / "shapes"
    assert config_command_of(shapes / "pretrain_sd3.yaml") == "pretrain"
    assert config_command_of(shapes / "sft_qwen_vl.yaml") == "sft"
    assert config_command_of(shapes / "flow_grpo.yaml") == "train"
    assert config_command_of(None) == "train"
    assert main(["config", "validate", str(shapes / "pretrain_sd3_mislabeled.yaml")]) == 0
    assert capsys.readouterr().out.strip() == f"{shapes / 'pretrain_sd3_mislabeled.yaml'}: ok (an `mmrl pretrain` config)"
    assert main(["config", "validate", "--no-check-files", str(shapes / "sft_qwen_vl.yaml")]) == 0
    assert "ok (an `mmrl sft` config, files not checked)" in capsys.readouterr().out
    assert main(["config", "validate", str(shapes / "pretrain_sd3.yaml"), "transformer.num_layerz=2"]) == 2
    one_error(capsys, "unknown config key 'transformer.num_layerz'", "did you mean 'transformer.num_layers'?")
    assert main(["config", "validate", str(shapes / "sft_qwen_vl.yaml"), "data.train=/no/such.jsonl"]) == 2
    one_error(capsys, "data.train: file not found")
    assert main(["config", "show", str(shapes / "pretrain_sd3.yaml")]) == 0
    assert "image_size: 32" in capsys.readouterr().out


def test_config_validate_of_an_sft_config_says_ok_only_when_its_data_is(tmp_path, capsys):
    from fixtures import write_image, write_jsonl

    write_image(tmp_path / "a.png", 32, 32)
    data = write_jsonl(tmp_path / "sft.jsonl", [{"image": "a.png", "question": "q", "solution": "s"}])  # no target
    sft = REPO / "configs" / "shapes" / "sft_qwen_vl.yaml"
    assert main(["config", "validate", str(sft), f"data.train={data}"]) == 2
    out = capsys.readouterr()
    assert "ok" not in out.out and "sft_target" in out.err


def test_train_with_overrides_and_no_config(monkeypatch):
    seen = {}

    def fake_train(args):
        seen.update(config=args.config, overrides=args.overrides)
        return 0

    monkeypatch.setattr(mmrl.cli, "_cmd_train", fake_train)
    assert main(["train", "train.steps=4", "seed=1"]) == 0
    assert seen == {"config": None, "overrides": ["train.steps=4", "seed=1"]}
    assert main(["train", str(VLM_CONFIG), "train.steps=4"]) == 0
    assert seen == {"config": str(VLM_CONFIG), "overrides": ["train.steps=4"]}


def test_version_and_python_dash_m(capsys):
    from importlib import metadata

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mmrl {metadata.version('mmrl-align')}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mmrl", "--version"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("mmrl ")
    proc = subprocess.run([sys.executable, "-m", "mmrl", "config", "validate", "--no-check-files", str(GPU_CONFIG)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "mmrl", "train", "train.stpes=1"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 2 and "did you mean 'train.steps'" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------- sample


def test_sample_prompts_file_and_fresh_output_folders(flow_run, tmp_path, capsys):
    txt = tmp_path / "p.txt"
    txt.write_text("a red apple\n\na blue boat\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a cat", "tag": 1}\n')
    assert main(["sample", str(flow_run), "--prompts", str(txt), "--seeds", "0", "1"]) == 0
    first = flow_run / "sampled" / "step_1-1"
    assert sorted(p.name for p in first.iterdir()) == ["grid.png", "p0_s0.png", "p0_s1.png", "p1_s0.png",
                                                      "p1_s1.png", "prompts.txt"]
    assert (first / "prompts.txt").read_text() == "a red apple\na blue boat\n"
    assert Image.open(first / "grid.png").size == (2 * 32, 2 * 32)
    before = (first / "grid.png").read_bytes()
    # a second call never overwrites the first one's images
    assert main(["sample", str(flow_run), "--prompt", "a dog", "--prompts", str(jsonl)]) == 0
    second = flow_run / "sampled" / "step_1-2"
    assert (second / "prompts.txt").read_text() == "a dog\na cat\n"
    assert (first / "grid.png").read_bytes() == before
    assert "step_1-2" in capsys.readouterr().out


def test_sample_refuses_a_used_out_folder_unless_overwrite(flow_run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with monkeypatch.context() as patch:
        patch.setattr(mmrl.build, "build_policy", lambda *a, **k: pytest.fail("model loaded"))
        assert main(["sample", str(flow_run), "--prompt", "a cat", "--out", str(out)]) == 2
    one_error(capsys, f"--out {out} already holds files", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["sample", str(flow_run), "--prompt", "a cat", "--out", str(out), "--overwrite"]) == 0
    assert (out / "grid.png").is_file() and (out / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("extra,words", [
    (["--question", "what?"], ["--question: for vision-language runs", "--prompt TEXT or --prompts FILE"]),
    (["--prompt", "a", "--image", "x.png"], ["--image: for vision-language runs"]),
    ([], ["give the prompts to draw"]),
    (["--prompts", "nope.txt"], ["prompt file not found: nope.txt"]),
    (["--prompt", "a", "--steps", "0"], ["--steps must be >= 1"]),
    (["--prompt", "a", "--seeds", "99999999999999999999"], ["--seeds: 99999999999999999999 is not a seed"]),
    (["--prompt", "a", "--seeds", "-1"], ["--seeds: -1 is not a seed"]),
    (["--prompt", "a", "--seeds", "3", "3"], ["--seeds lists a seed twice (3 3)"]),
])
def test_sample_flag_mistakes_on_an_image_run(flow_run, extra, words, capsys, no_model):
    assert main(["sample", str(flow_run), *extra]) == 2
    one_error(capsys, *words)


def test_sample_with_overrides_that_change_the_lora_shape(flow_run, tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["sample", str(flow_run), "--prompt", "a cat", "model.lora_rank=4", "--out", str(out)]) == 2
    one_error(capsys, "have another shape than the policy's", "LoRA setup")
    assert not out.exists()


def test_sample_missing_run(tmp_path, capsys, no_model):
    assert main(["sample", str(tmp_path / "nope"), "--prompt", "a"]) == 2
    one_error(capsys, "no such run or checkpoint folder")
    assert main(["sample", str(tmp_path), "--prompt", "a"]) == 2
    one_error(capsys, "neither a checkpoint folder nor a run folder")


def test_sample_vlm_answers_questions_about_images(vlm_run, tmp_path, capsys):
    image = tmp_path / "red.png"
    Image.new("RGB", (56, 56), (200, 30, 30)).save(image)
    assert main(["sample", str(vlm_run), "--question", "Where is the red box?", "--question", "What colour?",
                 "--image", str(image)]) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (vlm_run / "sampled" / "step_1-1" / "answers.jsonl").read_text().splitlines()]
    assert [r["question"] for r in rows] == ["Where is the red box?", "What colour?"]
    assert all(r["images"] == [str(image.absolute())] and r["video"] is None for r in rows)
    assert all(isinstance(r["answer"], str) for r in rows)
    assert "Q: Where is the red box?" in out and "answers.jsonl" in out
    # greedy decoding: the same answers again, in a fresh folder
    assert main(["sample", str(vlm_run), "--question", "Where is the red box?", "--image", str(image),
                 "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "answers.jsonl").read_text())
    assert again["answer"] == rows[0]["answer"]
    # the checkpoint folder itself works too (items are mmrl.data.vlm.VLMSample, answered by sample_eval)
    assert main(["sample", str(vlm_run / "checkpoints" / "step_1"), "--question", "Any box?"]) == 0


@pytest.mark.parametrize("extra,words", [
    (["--prompt", "a cat"], ["--prompt: for image-generation runs", "--question Q"]),
    (["--question", "q", "--seeds", "1"], ["--seeds: for image-generation runs"]),
    ([], ["give --question Q"]),
    (["--question", "q", "--image", "nope.png"], ["--image nope.png: file not found"]),
    (["--question", "q", "--video", "nope.mp4"], ["--video nope.mp4: file not found"]),
])
def test_sample_flag_mistakes_on_a_vlm_run(vlm_run, extra, words, capsys, no_model):
    assert main(["sample", str(vlm_run), *extra]) == 2
    one_error(capsys, *words)


def test_sample_unreadable_image_on_a_vlm_run(vlm_run, tmp_path, capsys, no_model):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    assert main(["sample", str(vlm_run), "--question", "q", "--image", str(bad)]) == 2
    one_error(capsys, f"--image {bad}: not a readable image")


# ---------------------------------------------------------------------------------------------- reward server


def test_dead_reward_server_is_found_before_the_model_loads(cache, tmp_path, capsys, no_model):
    run = tmp_path / "run"
    port = free_port()  # nothing listens there (127.0.0.1 only)
    start = time.monotonic()
    code = main(["train", TINY_RECIPE, f"output_dir={run}", *TINY, "train.steps=1",
                 f"rewards={{remote: {{kwargs: {{url: 'http://127.0.0.1:{port}', retries: 0}}}}}}"])
    assert code == 2
    one_error(capsys, "rewards.remote:", f"http://127.0.0.1:{port}/health", "Connection refused")
    assert time.monotonic() - start < 60
    assert not run.exists()


class _Boom:
    name = "boom"
    needs_prompts = False
    last_info: dict = {}

    def __call__(self, images, prompts=None, metadata=None):
        raise RuntimeError("the reward model crashed")


def test_reward_server_failing_mid_run_is_one_line(cache, tmp_path, capsys):
    from mmrl.rewards.remote import RewardServer

    with RewardServer(_Boom(), "127.0.0.1", 0) as server:  # /health answers, /score fails
        code = main(["train", TINY_RECIPE, f"output_dir={tmp_path / 'run'}", *TINY, "train.steps=1",
                     f"rewards={{remote: {{kwargs: {{url: '{server.url}', retries: 0}}}}}}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"mmrl: error: reward server {server.url}/score")
    assert "the reward model crashed" in err


# ---------------------------------------------------------------------------------------------- interrupts


def test_ctrl_c_outside_the_trainer_prints_interrupted(monkeypatch, capsys):
    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(mmrl.build, "build_trainer", interrupted)
    assert main(["train", "train.steps=1"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "mmrl: interrupted" and "Traceback" not in err


@pytest.mark.parametrize("stopped,code", [("SIGTERM", 143), ("SIGINT", 130), ("a signal on another process", 130)])
def test_a_run_stopped_by_a_signal_exits_with_its_code(monkeypatch, capsys, stopped, code):
    class Stopped:
        stopped_by = stopped
        update = 3

        def train(self):
            return [{"reward/mean": 0.5}]

    monkeypatch.setattr(mmrl.build, "build_trainer", lambda config: Stopped())
    assert main(["train", "train.steps=10"]) == code
    assert "done:" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- progress bars


def test_library_loading_bars_are_off_unless_mmrl_verbose(tmp_path, capsys, monkeypatch):
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    try:
        monkeypatch.delenv("MMRL_VERBOSE", raising=False)
        assert main(["tiny", "sd3", str(tmp_path / "quiet")]) == 0
        assert "Writing model shards" not in capsys.readouterr().err
        assert not transformers_logging.is_progress_bar_enabled()
        assert not diffusers_logging.is_progress_bar_enabled()
        transformers_logging.enable_progress_bar()
        diffusers_logging.enable_progress_bar()
        monkeypatch.setenv("MMRL_VERBOSE", "1")
        assert main(["tiny", "sd3", str(tmp_path / "verbose")]) == 0
        assert "Writing model shards" in capsys.readouterr().err
    finally:
        transformers_logging.enable_progress_bar()
        diffusers_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------- tiny cache


def test_stale_build_folders_are_removed_when_building(tmp_path):
    from mmrl.pipelines.flow.tiny import ensure_built

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - 2 * 3600
    names = {
        f".tiny-x-v1.tmp-{dead.pid}-abc": False,  # killed builder, two hours old: removed
        ".tiny-x-v1.tmp-legacy": False,  # no pid in the name (older mmrl), two hours old: removed
        f".tiny-x-v1.stale-{dead.pid}-def": False,  # a set-aside folder whose removal was killed: removed
        f".tiny-x-v1.tmp-{os.getppid()}-ghi": True,  # its builder still runs: kept
        f".tiny-y-v1.tmp-{dead.pid}-jkl": True,  # another entry's: not this build's business
    }
    for name in names:
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "weights.bin").write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    recent = tmp_path / f".tiny-x-v1.tmp-{dead.pid}-new"
    recent.mkdir()  # under an hour old: kept (it may be a build on another machine sharing the cache)

    final = ensure_built("tiny-x-v1", lambda path: (Path(path) / "config.json").write_text("{}"), tmp_path)
    assert (final / "config.json").is_file()
    for name, kept in names.items():
        assert (tmp_path / name).exists() == kept, name
    assert recent.exists()
    assert not [p for p in tmp_path.glob(".tiny-x-v1.tmp-*") if p.name.endswith(("-abc", "legacy"))]


RACE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from mmrl.pipelines.flow.tiny import ensure_built

    cache, log = sys.argv[1], sys.argv[2]

    def builder(path):
        with open(log, "a") as handle:
            handle.write(f"{os.getpid()}\\n")
        (Path(path) / "weights.bin").write_bytes(b"x" * 4096)
        time.sleep(1.0)
        (Path(path) / "config.json").write_text("{}")

    for _ in range(20):  # load from the entry again and again, as ranks do
        final = ensure_built("tiny-race-v1", builder, cache)
        if not (final / "config.json").is_file():
            sys.exit(f"{final} has no config.json")
        time.sleep(0.02)
    print(final)
""")


@pytest.mark.parametrize("leftover", [False, True])
def test_concurrent_builds_build_once_and_never_expose_an_incomplete_folder(tmp_path, leftover):
    cache, log = tmp_path / "cache", tmp_path / "builds.log"
    if leftover:  # an unmarked folder where the build goes: set aside once, by the one builder
        (cache / "tiny-race-v1").mkdir(parents=True)
        (cache / "tiny-race-v1" / "partial.bin").write_bytes(b"?")
    script = tmp_path / "race.py"
    script.write_text(RACE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(cache), str(log)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == str(cache / "tiny-race-v1")
    assert len(log.read_text().splitlines()) == 1  # one build; the others waited for it and reused it
    final = cache / "tiny-race-v1"
    assert (final / "config.json").is_file() and not (final / "partial.bin").exists()
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-race-v1"]  # no temporary, set-aside or lock file


# ---------------------------------------------------------------------------------------------- benchmark


def test_credit_curves_writes_to_out_not_to_the_committed_results(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("credit_curves", REPO / "benchmarks" / "credit_curves.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = REPO / "benchmarks" / "results" / "credit_curves.csv"
    before = results.read_bytes() if results.exists() else None

    assert module.method_variants("outcome") == "algorithm.variants=[]"
    assert module.method_variants("vig") == "algorithm.variants=[vig]"
    assert module.method_variants("blockwise={scopes: {iou: answer}}") == \
        "algorithm.variants=[{name: blockwise, scopes: {iou: answer}}]"

    def fake_run(method, seconds, evals, eval_limit, seed, workdir, recipe, pretrained, benchmark, blind):
        rows = [{"method": method, "step": s + 1, "reward": 0.1 * s, "wall_s": float(s), "extra_nfe": 0.0,
                 "reward_calls": 4.0} for s in range(int(seconds))]
        held = [{"method": method, "seconds": seconds * k / evals, "trained_s": seconds * k / evals + 0.5,
                 "update": k, "overall": 0.1 * k, "tag/colors": 0.2 * k} for k in range(evals + 1)]
        return rows, held

    monkeypatch.setattr(module, "run", fake_run)
    out = tmp_path / "bench"
    module.main(["--seconds", "3", "--evals", "2", "--methods", "outcome", "cosine", "--out", str(out)])
    assert (out / "credit_curves.csv").read_text().splitlines()[0] == "method,step,reward,wall_s,extra_nfe,reward_calls"
    assert (out / "credit_heldout.csv").read_text().splitlines()[0] == "method,seconds,trained_s,update,overall,tag/colors"
    assert len((out / "credit_heldout.csv").read_text().splitlines()) == 1 + 2 * 3
    assert (out / "credit_curves.png").is_file()
    monkeypatch.chdir(tmp_path)
    module.main(["--seconds", "3", "--methods", "outcome"])  # the default: runs/credit_curves under the cwd
    assert (tmp_path / "runs" / "credit_curves" / "credit_curves.csv").is_file()
    with pytest.raises(SystemExit):
        module.main(["--seconds", "0"])
    assert (results.read_bytes() if results.exists() else None) == before


def test_the_done_line_reports_the_reward_of_the_first_and_last_quarter_of_the_run():
    from mmrl.cli import reward_trend

    rows = [{"reward/mean": r} for r in (0.0, 1.0, 0.2, 0.4, 0.6, 0.8, 0.1, 0.3)]
    # a quarter of 8 updates is 2: (0 + 1) / 2 and (0.1 + 0.3) / 2, not the last single update's 0.3
    assert reward_trend(rows) == "reward 0.5 -> 0.2 (mean of the first and of the last 2 updates)"
    assert reward_trend(rows * 10).endswith("(mean of the first and of the last 10 updates)")  # at most 10
    assert reward_trend(rows[:3]) == "reward 0 -> 0.2"
    assert reward_trend([{"loss": 1.0}]) == "no reward logged"


def test_an_in_training_benchmark_whose_weights_are_missing_is_one_line(tmp_path, capsys, monkeypatch):
    """The scorer of an in-training benchmark is built once the policy is: weights it cannot find offline (here
    T2I-CompBench's BLIP-VQA) stop `mmrl train` with one line, not a traceback."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache("Salesforce/blip-vqa-capfilt-large", "config.json"), str):
        pytest.skip("the BLIP-VQA weights are in this machine's hub cache: nothing is missing")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["train", TINY_RECIPE, f"output_dir={tmp_path}", "train.steps=1", "eval.every=1",
                 "eval.benchmarks=[t2i_compbench]", "eval.limit=1", "logging.progress_bar=false"])
    assert code == 2
    one_error(capsys, "t2i_compbench", "set blip_model=")


def test_a_pretrain_or_sft_run_given_where_a_training_run_goes_says_what_it_is(tmp_path, capsys):
    """`mmrl sample|eval|doctor` on an `mmrl pretrain` or `mmrl sft` run folder (or its config.yaml, or a checkpoint
    in it) said "unknown config key 'image_size'"; they now say what the folder holds and how to use it."""
    from mmrl.checkpoint import COMPLETE_MARKER

    pre, sft = tmp_path / "pre", tmp_path / "sft"
    for run in (pre, sft):
        (run / "checkpoints" / "step_2").mkdir(parents=True)
        for name in ("trainable.safetensors", COMPLETE_MARKER):  # a complete checkpoint, as theirs are
            (run / "checkpoints" / "step_2" / name).write_bytes(b"")
        (run / "config.yaml").write_text("seed: 0\n")
    (pre / "pipeline").mkdir()
    (pre / "pipeline" / "model_index.json").write_text("{}")
    (sft / "model").mkdir()
    (sft / "mmrl_train.yaml").write_text("model: {}\n")
    for args, words in ((["sample", str(pre), "--prompt", "x"], f"{pre} is an mmrl pretrain run"),
                        (["sample", str(pre / "checkpoints" / "step_2"), "--prompt", "x"],
                         f"{pre} is an mmrl pretrain run"),
                        (["eval", str(sft), "limit=1"], f"{sft} is an mmrl sft run: its result is the model"),
                        # a VLM benchmark's key read as an unknown image-benchmark key before
                        (["eval", str(sft), "benchmarks=[rec]", "data=d.jsonl"], f"{sft} is an mmrl sft run"),
                        (["doctor", str(pre / "config.yaml")], f"use it as model.pretrained"),
                        (["config", "validate", str(sft / "config.yaml")], f"{sft / 'mmrl_train.yaml'} holds")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and "unknown config key" not in err
