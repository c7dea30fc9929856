"""benchmarks/vlm_grpo_vs_trl.py: a smoke run of the mmrl-vs-TRL GRPO benchmark (skipped without TRL).

Not a performance test: it checks that both frameworks run the same step workload (completions, optimizer
steps, prompt token ids, trainable parameters, language-model forwards) and that the vision-encoder counts
show the difference the benchmark is about (mmrl: one image per prompt per step; TRL: one per completion per
forward).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "vlm_grpo_vs_trl.py"


def test_vlm_grpo_vs_trl_smoke(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "bench.json"
    prompts, group, batch, epochs = 1, 2, 2, 2
    cmd = [sys.executable, str(SCRIPT), "--steps", "1", "--prompts", str(prompts), "--group", str(group),
           "--batch-size", str(batch), "--inner-epochs", str(epochs), "--max-new-tokens", "4", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workload_problems"] == []
    assert report["versions"]["trl"]
    n = prompts * group
    mmrl, trl = report["mmrl"], report["trl"]
    assert mmrl["optimizer_steps_per_step"] == trl["optimizer_steps_per_step"] == epochs * n // batch
    assert report["workload_checks"]["prompt_token_ids_identical_samples"] > 0
    # the same language-model work: generation (prefill + decode) + old log-probs + training forwards
    assert mmrl["counts_per_step"]["lm_calls"] == trl["counts_per_step"]["lm_calls"]
    assert mmrl["counts_per_step"]["lm_grad_calls"] == trl["counts_per_step"]["lm_grad_calls"] == epochs * n // batch
    # vision: mmrl encodes each prompt's image once; TRL once per completion in generation, old log-probs and
    # every training forward
    assert mmrl["counts_per_step"]["vision_images"] == prompts
    assert trl["counts_per_step"]["vision_images"] == n * (2 + epochs)
    assert report["ratio_steps_per_s_mmrl_over_trl"] > 0
