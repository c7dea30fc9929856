"""Server mode of the vLLM rollout engine (mmrl.pipelines.vlm.vllm_server; generation.vllm_server).

Without vLLM: the HTTP front and its client around a recording engine: requests arrive pixel for pixel, weights byte
for byte (in chunks), the main process pushes only when the server holds other weights and the other processes wait
for them, a dead or mismatched server is a clear error, and the config rules. The real engine behind the server is
tested in tests/test_vllm_engine.py where vLLM is installed."""
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.config import ConfigError
from mmrl.pipelines.vlm.vllm_server import (VLLMServerClient, VLLMServerError, decode_payload, encode_payload,
                                            make_vllm_server, weights_fingerprint)
from tests.test_vllm_engine import config, perturb, tiny_policy

REPO = Path(__file__).resolve().parents[1]


class RecordingEngine:
    """What the server fronts: records pushes and requests; each completion is the prompt's ids reversed, with a
    log-prob per token."""

    def __init__(self):
        self.pushes = 0
        self.pushed: list[dict] = []
        self.requests: list[tuple] = []

    def push(self, weights):
        self.pushed.append({name: tensor.clone() for name, tensor in weights})
        self.pushes += 1

    def generate(self, prompts, **params):
        self.requests.append((prompts, params))
        n = 1 if params.get("greedy") else params["n"]
        return [(p["prompt_token_ids"], [p["prompt_token_ids"][::-1]] * n,
                 [[-0.125 * (k + 1) for k in range(len(p["prompt_token_ids"]))]] * n) for p in prompts]


@pytest.fixture
def server():
    engine = RecordingEngine()
    http = make_vllm_server(engine, port=0, model="tiny", dtype="float32", max_model_len=4096)
    thread = threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{http.server_address[1]}", engine
    http.shutdown()
    http.server_close()


def client(url, **kwargs):
    return VLLMServerClient(url, dtype="float32", max_model_len=256, timeout=kwargs.pop("timeout", 5.0), **kwargs)


def test_payload_round_trip_is_exact():
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (9, 7, 3), dtype=np.uint8))
    frames = rng.integers(0, 256, (4, 6, 5, 3), dtype=np.uint8)
    request = {"prompt_token_ids": [1, 2, 3], "multi_modal_data": {
        "image": [image, image.convert("L")], "video": (frames, {"fps": 2.0, "frames_indices": [0, 1, 2, 3]})},
        "weights": np.arange(5, dtype=np.float32) / 3}
    back = decode_payload(encode_payload(request))
    images = back["multi_modal_data"]["image"]
    assert [im.mode for im in images] == ["RGB", "L"] and images[0].size == (7, 9)
    assert np.array_equal(np.asarray(images[0]), np.asarray(image))
    assert np.array_equal(np.asarray(images[1]), np.asarray(image.convert("L")))
    video = back["multi_modal_data"]["video"]
    assert isinstance(video, tuple) and video[0].dtype == np.uint8 and np.array_equal(video[0], frames)
    assert video[1] == {"fps": 2.0, "frames_indices": [0, 1, 2, 3]}
    assert back["weights"].dtype == np.float32 and np.array_equal(back["weights"], request["weights"])
    assert back["prompt_token_ids"] == [1, 2, 3]


def test_generate_through_the_server(server):
    url, engine = server
    image = Image.fromarray(np.full((4, 4, 3), 200, dtype=np.uint8))
    prompts = [{"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": image}},
               {"prompt_token_ids": [8, 9]}]
    params = dict(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1, max_tokens=16,
                  stop_token_ids=[2], suppressed_ids=[11, 12], seed=1234, greedy=False)
    results = client(url).generate(prompts, **params)
    assert results == RecordingEngine().generate(prompts, **params)
    (received, got_params), = engine.requests
    assert got_params == params  # every sampling setting reaches the engine unchanged
    assert np.array_equal(np.asarray(received[0]["multi_modal_data"]["image"]), np.asarray(image))
    assert received[1] == {"prompt_token_ids": [8, 9]}


def test_weights_arrive_exactly_in_chunks(server):
    url, engine = server
    weights = [("a.weight", torch.randn(64, 64)), ("b.weight", torch.randn(32, dtype=torch.bfloat16)),
               ("c.weight", torch.randn(64, 64))]
    c = client(url, chunk_mb=20_000 / 2**20)  # 20 kB: the 16 kB matrices cannot share a request
    c.push(weights, "fp-1")
    assert engine.pushes == 2  # [a, b] (16 kB + 64 B), then [c]
    received = {k: v for chunk in engine.pushed for k, v in chunk.items()}
    assert set(received) == {"a.weight", "b.weight", "c.weight"}
    for name, tensor in weights:
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
    assert c.health()["fingerprint"] == "fp-1" and c.pushes == 1


def test_main_process_pushes_only_when_the_server_holds_other_weights(server):
    url, engine = server
    c = client(url)
    weights = [("w", torch.ones(3))]
    calls = []

    def make():
        calls.append(1)
        return weights

    c.sync("fp-a", make)
    c.sync("fp-a", make)
    assert len(calls) == 1 and engine.pushes == 1
    c.sync("fp-b", make)
    assert len(calls) == 2 and c.health()["fingerprint"] == "fp-b"


def test_other_processes_wait_for_the_main_push(server):
    url, engine = server
    main, other = client(url, main_process=True), client(url, main_process=False)
    done = []
    waiter = threading.Thread(target=lambda: (other.sync("fp-x", lambda: pytest.fail("only RANK 0 pushes")),
                                              done.append(time.monotonic())))
    waiter.start()
    time.sleep(0.3)
    assert not done  # still waiting: the server holds the checkpoint's weights
    pushed_at = time.monotonic()
    main.sync("fp-x", lambda: [("w", torch.zeros(2))])
    waiter.join(5)
    assert done and done[0] >= pushed_at and other.waits == 1 and engine.pushes == 1


def test_waiting_for_weights_that_never_come_is_an_error(server):
    url, _ = server
    other = client(url, main_process=False, timeout=0.3)
    with pytest.raises(VLLMServerError, match="still holds weights None .*RANK 0"):
        other.sync("fp-never", lambda: [])


def test_unreachable_or_mismatched_server_is_a_clear_error(server):
    url, _ = server
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match="unreachable.*mmrl vllm-serve"):
        client("http://127.0.0.1:9", timeout=0.5)
    assert time.monotonic() - start < 5
    with pytest.raises(VLLMServerError, match="bfloat16"):
        VLLMServerClient(url, dtype="bfloat16", max_model_len=256, timeout=2)
    with pytest.raises(VLLMServerError, match="takes 4096 tokens .* needs 8192"):
        VLLMServerClient(url, dtype="float32", max_model_len=8192, timeout=2)


def test_bad_requests_get_400_and_the_server_keeps_serving(server):
    url, engine = server
    c = client(url)
    with pytest.raises(VLLMServerError, match="400: .*not a safetensors"):
        c._request("/push", b"not safetensors", {"X-Weights-Final": "1"})
    with pytest.raises(VLLMServerError, match="400: .*prompt_token_ids"):
        c._request("/generate", b'{"prompts": [{"text": "hi"}], "n": 1}')
    with pytest.raises(VLLMServerError, match="404"):
        c._request("/nowhere")
    assert c.health()["status"] == "ok" and engine.pushes == 0


def test_policy_pushes_its_merged_weights_once_per_change(server, tmp_path):
    from mmrl.pipelines.vlm.vllm_engine import merged_weights

    url, engine = server
    policy = tiny_policy(tmp_path, sampler=client(url))
    policy._sync_sampler()
    policy._sync_sampler()
    assert engine.pushes == 1
    trained = policy.named_trainable_parameters()
    expected = dict(merged_weights(policy.model, trained=trained, use_lora=policy.use_lora, dtype=policy.dtype))
    assert set(engine.pushed[0]) == set(expected)
    assert all(torch.equal(engine.pushed[0][k], v) for k, v in expected.items())
    assert policy.sampler.health()["fingerprint"] == weights_fingerprint(trained.items())
    perturb(policy.trainable_parameters())
    policy._sync_sampler()
    assert engine.pushes == 2
    changed = dict(merged_weights(policy.model, trained=trained, use_lora=policy.use_lora, dtype=policy.dtype))
    assert all(torch.equal(engine.pushed[1][k], v) for k, v in changed.items())


def test_fingerprint_follows_the_values():
    a = {"x": torch.arange(6.0).view(2, 3), "y": torch.ones(2)}
    same = {"x": torch.arange(6.0).view(2, 3).clone(), "y": torch.ones(2)}
    assert weights_fingerprint(a.items()) == weights_fingerprint(same.items())
    nudged = {"x": a["x"] + 1e-6, "y": a["y"]}
    assert weights_fingerprint(nudged.items()) != weights_fingerprint(a.items())
    assert weights_fingerprint({"x": a["x"].view(3, 2), "y": a["y"]}.items()) != weights_fingerprint(a.items())


def test_server_mode_builds_a_client_for_several_processes(server, tmp_path, monkeypatch):
    from mmrl.build import build_vlm_sampler

    url, _ = server
    monkeypatch.setenv("WORLD_SIZE", "2")
    c = config(tmp_path, "generation.engine=vllm", f"generation.vllm_server={url}",
               "generation.vllm_server_timeout=7", check_files=False)
    sampler = build_vlm_sampler(c)
    assert isinstance(sampler, VLLMServerClient) and sampler.timeout == 7.0 and sampler.url == url
    with pytest.raises(ConfigError, match="serve vLLM apart"):
        build_vlm_sampler(config(tmp_path, "generation.engine=vllm", check_files=False))


@pytest.mark.parametrize("overrides, words", [
    (["generation.vllm_server=http://localhost:8000"], "generation.engine: vllm"),
    (["generation.engine=vllm", "generation.vllm_server=localhost:8000"], "must be a URL"),
    (["generation.engine=vllm", "generation.vllm_server=http://h:1", "generation.vllm_server_timeout=0"], "> 0"),
    (["generation.engine=vllm", "generation.vllm_server_timeout=5"], "server mode"),
])
def test_server_config_rules(tmp_path, overrides, words):
    with pytest.raises(ConfigError, match=words):
        config(tmp_path, *overrides, check_files=False)


def test_server_mode_needs_no_vllm_on_the_training_machine(tmp_path):
    c = config(tmp_path, "generation.engine=vllm", "generation.vllm_server=http://127.0.0.1:8000")  # check_files
    assert c.generation.vllm_server == "http://127.0.0.1:8000"


def test_vllm_serve_rejects_a_flow_config(capsys):
    from mmrl.cli import main

    assert main(["vllm-serve", str(REPO / "configs/tiny/flow_grpo.yaml")]) == 2
    assert "model.family: qwen_vl" in capsys.readouterr().err


def test_vllm_serve_without_vllm_is_a_clear_error(capsys, tmp_path):
    from mmrl.cli import main
    from mmrl.pipelines.vlm.vllm_engine import vllm_missing

    if vllm_missing() is None:
        pytest.skip("vLLM is installed here: the missing-engine error cannot be shown")
    assert main(["vllm-serve", str(REPO / "configs/tiny/vlm_grounding.yaml"), f"output_dir={tmp_path}"]) == 2
    assert "needs vLLM" in capsys.readouterr().err


def test_launching_a_server_that_cannot_start_reports_its_output(tmp_path):
    from mmrl.pipelines.vlm.vllm_engine import vllm_missing
    from mmrl.pipelines.vlm.vllm_server import launch_vllm_server

    if vllm_missing() is None:
        pytest.skip("vLLM is installed here: the server would start")
    with pytest.raises(VLLMServerError, match=r"exited with 2 before listening:\n.*needs vLLM"):
        launch_vllm_server(REPO / "configs/tiny/vlm_grounding.yaml", [f"output_dir={tmp_path}"], timeout=120)
