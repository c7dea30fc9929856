"""benchmarks/flow_grpo_official.py (the official Flow-GRPO side of ``mmrl bench flow-grpo``) and when the bench
skips that side.

Flow-GRPO itself is not part of the project and cannot be downloaded in a test, so the runner is checked against a
stand-in checkout written here: a ``scripts/train_sd3.py`` that behaves as the official script does where the
runner observes it (``wandb.init``, one ``{"epoch": ...}`` log per epoch after sampling, transformer calls with and
without grad, one optimizer step per epoch, a ``{"epoch", "inner_epoch"}`` log per step, never returning)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

STAND_IN = '''
import sys, time, torch, wandb
from diffusers import SD3Transformer2DModel

model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                              num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                              pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
assert sys.argv[1:] == ["--config", "config/grpo.py:compressibility"], sys.argv
wandb.init(project="stand-in")

def call(rows):
    return model(hidden_states=torch.randn(rows, 4, 8, 8), encoder_hidden_states=torch.randn(rows, 7, 16),
                 pooled_projections=torch.randn(rows, 8), timestep=torch.ones(rows)).sample

epoch = 0
while True:
    with torch.no_grad():
        for _ in range(3):  # sampling: 3 steps of 4 rows
            call(4)
    time.sleep(0.05)
    wandb.log({"epoch": epoch, "reward_avg": 0.5})
    for _ in range(2):  # training: 2 trained steps of 4 rows, one optimizer step
        call(4).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    wandb.log({"epoch": epoch, "inner_epoch": 0, "loss": 0.0})
    epoch += 1
'''


def test_the_runner_times_epochs_and_counts_the_work_of_each(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train_sd3.py").write_text(STAND_IN)
    # wandb as the script sees it with WANDB_MODE=disabled (init returns a run, log does nothing); the checkout comes
    # first on the runner's sys.path, so this stand-in is what both import, with or without wandb installed
    (tmp_path / "wandb.py").write_text("def init(*args, **kwargs):\n    return object()\n\n"
                                       "def log(*args, **kwargs):\n    pass\n")
    proc = subprocess.run([sys.executable, str(BENCH / "flow_grpo_official.py"), "--checkout", str(tmp_path),
                           "--epochs", "3", "--threads", "1", "--", "--config", "config/grpo.py:compressibility"],
                          capture_output=True, text=True, timeout=300, env={"WANDB_MODE": "disabled",
                                                                            "HF_HUB_OFFLINE": "1",
                                                                            "PATH": "/usr/bin:/bin"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("FLOW_GRPO_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[0].split(" ", 1)[1])
    assert len(result["epoch_s"]) == 3 and all(t >= 0.05 for t in result["epoch_s"])  # each holds one sleep
    # between two epoch logs: one epoch's training (2 calls with grad, 1 optimizer step), the next one's sampling
    assert result["work"] == [{"rows_grad": 8, "rows_no_grad": 12, "calls_grad": 2, "calls_no_grad": 3,
                               "optimizer_steps": 1}] * 3
    assert result["shapes"] == {"latent": [4, 8, 8], "text_tokens": 7}
    # one more epoch under the tensor tracker: it holds at least one call's latents (4 x 4 x 8 x 8 fp32)
    assert result["peak_epoch_bytes"] >= 4 * 4 * 8 * 8 * 4


def test_the_bench_says_why_it_skips_the_official_side(tmp_path, monkeypatch):
    import importlib.util

    import flow_grpo_bench as bench

    assert "no --flow-grpo" in bench.official_missing(types.SimpleNamespace(flow_grpo=None))
    assert "no scripts/train_sd3.py" in bench.official_missing(types.SimpleNamespace(flow_grpo=str(tmp_path)))
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train_sd3.py").write_text("")
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ml_collections" else find(name))
    assert "pip install ml_collections" in bench.official_missing(types.SimpleNamespace(flow_grpo=str(tmp_path)))


def test_the_bench_runs_flow_grpos_128_t5_tokens_on_a_pipeline_that_states_them(tmp_path):
    """With --flow-grpo every side encodes 128 T5 tokens, as Flow-GRPO does; the tiny pipeline's tokenizer states
    32 and mmrl refuses to pad past it (the bench crashed building mmrl's side), so it runs on a copy stating 128."""
    from transformers import AutoTokenizer

    import flow_grpo_bench as bench
    from mmrl.config import load_config
    from mmrl.pipelines.flow.loading import resolve_pretrained, tokenizer_limit

    tiny = Path(resolve_pretrained("tiny:sd3"))
    copy = bench.with_t5_budget(tiny, 128, tmp_path)
    # the limit the SD3 family reads from the pipeline's tokenizer_3 (SD3Family.text_token_limit)
    assert tokenizer_limit(AutoTokenizer.from_pretrained(str(tiny / "tokenizer_3"))) == 32
    assert tokenizer_limit(AutoTokenizer.from_pretrained(str(copy / "tokenizer_3"))) == 128
    args = types.SimpleNamespace(pipeline=copy, prompts=2, group=4, num_steps=10, flow_grpo="x", set=[])
    overrides = bench.overrides(args, 4.5, tmp_path / "out")
    assert "sampling.max_sequence_length=128" in overrides and f"model.pretrained={copy}" in overrides
    load_config(bench.RECIPE, overrides, check_files=False)
