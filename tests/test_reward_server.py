"""The reward server (``mmrl serve-rewards``) and its client (``remote``), on loopback only.

Every server here binds 127.0.0.1 on a free port; every request loop is bounded in count and time.
"""
import base64
import http.server
import io
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from fixtures import tiny_clip
from PIL import Image

from mmrl.rewards import ComposedReward, Reward, build_reward, build_rewards, check_reward_arguments
from mmrl.rewards.remote import RemoteReward, RewardServer, RewardServerError, load_reward_spec

LOOPBACK = "127.0.0.1"


def u8_images(n=4, h=24, w=20, seed=0) -> torch.Tensor:
    """Float images that are exact multiples of 1/255 (uint8 on the wire is then lossless)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g).float() / 255.0


def to_pils(x: torch.Tensor) -> list:
    arr = (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a) for a in arr]


def assert_scores_equal(remote: dict, local: dict, main: str = "remote", atol=0.0, rtol=0.0):
    torch.testing.assert_close(remote[main], local["total"], atol=atol, rtol=rtol, equal_nan=True)
    for key, value in local.items():
        if key != "total":
            torch.testing.assert_close(remote[key], value.float(), atol=atol, rtol=rtol, equal_nan=True)


@pytest.fixture
def pixel_reward():
    return build_rewards({"brightness": 1.0, "colorfulness": 0.01, "jpeg_compressibility": {"weight": 0.5}})


@pytest.fixture
def server(pixel_reward):
    with RewardServer(pixel_reward, LOOPBACK, 0, max_batch=64, max_wait_ms=5) as srv:
        yield srv


def post(url, body: bytes, headers: dict, timeout=10.0):
    """(status, decoded JSON) for a raw POST; never raises for an HTTP error status."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# --------------------------------------------------------------------------------------------
# Scores equal local scoring
# --------------------------------------------------------------------------------------------


def test_health_names_rewards(server):
    info = RemoteReward(server.url, timeout=5).health()
    assert info["status"] == "ok"
    assert info["rewards"] == ["brightness", "colorfulness", "jpeg_compressibility"]
    assert info["weights"]["jpeg_compressibility"] == 0.5 and info["needs_prompts"] is False


@pytest.mark.parametrize("kwargs", [{}, {"wire_dtype": "float32"}, {"image_format": "png"}])
def test_remote_equals_local_tensor(server, pixel_reward, kwargs):
    x = u8_images(5)
    client = RemoteReward(server.url, timeout=10, retries=0, **kwargs)
    assert_scores_equal(client(x, None), pixel_reward(x, None))


def test_remote_float32_wire_is_exact_for_any_float(server, pixel_reward):
    x = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))  # not multiples of 1/255
    exact = RemoteReward(server.url, timeout=10, wire_dtype="float32")(x, None)
    assert_scores_equal(exact, pixel_reward(x, None))
    quantised = RemoteReward(server.url, timeout=10)(x, None)  # uint8 on the wire: within 1/510 per pixel
    torch.testing.assert_close(quantised["brightness"], pixel_reward(x, None)["brightness"], atol=2e-3, rtol=0)


def test_remote_equals_local_pil_mixed_sizes_and_nan(server, pixel_reward):
    pils = to_pils(u8_images(2, 16, 12)) + to_pils(u8_images(2, 20, 30, seed=3))
    batch = [pils[0], "not an image", pils[1], pils[2], pils[3]]
    client = RemoteReward(server.url, timeout=10)
    remote, local = client(batch, None), pixel_reward(batch, None)
    assert_scores_equal(remote, local)
    assert math.isnan(remote["remote"][1]) and client.last_info["num_nan"] == 1
    assert "not a PIL image" in client.last_info["nan_samples"][1]


def test_server_nan_reasons_come_back(server):
    x = u8_images(4)
    x[2, 0, 0, 0] = float("inf")  # float32 on the wire: the server itself sees the bad sample
    client = RemoteReward(server.url, timeout=10, wire_dtype="float32")
    out = client(x, None)
    assert math.isnan(out["remote"][2]) and torch.isfinite(out["remote"][[0, 1, 3]]).all()
    assert client.last_info["num_nan"] == 1


def tiny_pickscore(tmp_path):
    model, processor = tiny_clip(tmp_path, extra_tokens=())
    return build_reward("pickscore", model=model, processor=processor, device="cpu")


def test_remote_pickscore_with_prompts_equals_local(tmp_path):
    local = ComposedReward({"pickscore": (tiny_pickscore(tmp_path), 1.0)})
    x, prompts = u8_images(4, 40, 36), ["a cat", "a dog", "a cat", "red"]
    with RewardServer(local, LOOPBACK, 0) as srv:
        client = RemoteReward(srv.url, timeout=20)
        assert client.health()["needs_prompts"] is True
        assert_scores_equal(client(x, prompts), local(x, prompts), atol=1e-6, rtol=1e-6)
        with pytest.raises(RewardServerError, match="400.*prompt"):
            client(x, None)


def test_remote_in_a_training_style_config(server, pixel_reward):
    spec = {"remote": {"kwargs": {"url": server.url, "timeout": 5, "retries": 1, "backoff": 0.1}},
            "brightness": 0.0}
    check_reward_arguments("remote", spec["remote"]["kwargs"])  # what config validation does
    composed = build_rewards(spec)
    x = u8_images(3)
    out, local = composed(x, ["p"] * 3), pixel_reward(x, None)
    torch.testing.assert_close(out["remote"], local["total"])
    torch.testing.assert_close(out["remote/brightness"], local["brightness"].float())
    torch.testing.assert_close(out["total"], local["total"])  # brightness has weight 0


def test_a_bare_reward_is_served_with_a_total(pixel_reward):
    x = u8_images(2)
    with RewardServer(build_reward("brightness"), LOOPBACK, 0) as srv:
        out = RemoteReward(srv.url, timeout=10)(x, None)
    torch.testing.assert_close(out["remote"], pixel_reward(x, None)["brightness"].float())
    torch.testing.assert_close(out["brightness"], out["remote"])


def test_text_completions_are_served():
    local = build_rewards({"think_answer_format": 1.0})
    completions = ["<think>x</think><answer>A</answer>", "no tags", "<think>y</think><answer>B</answer>"]
    with RewardServer(local, LOOPBACK, 0) as srv:
        out = RemoteReward(srv.url, timeout=10)(completions, ["q"] * 3, [{}] * 3)
    torch.testing.assert_close(out["remote"], local(completions, ["q"] * 3, [{}] * 3)["total"], equal_nan=True)


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


def test_concurrent_requests_are_merged(pixel_reward):
    calls = []

    class Spy(Reward):
        name = "spy"

        def _score(self, batch, reasons):
            calls.append(len(batch.valid_indices))
            (_, images), = batch.float_groups()  # tensor input: one group
            return {self.name: images.double().mean(dim=(1, 2, 3))}

    reward = ComposedReward({"spy": (Spy(), 1.0), "brightness": (build_reward("brightness"), 1.0)})
    n_clients, per = 8, 2
    images = [u8_images(per, seed=i) for i in range(n_clients)]
    results: dict[int, dict] = {}
    with RewardServer(reward, LOOPBACK, 0, max_batch=64, max_wait_ms=300) as srv:
        barrier = threading.Barrier(n_clients)

        def client(i):
            barrier.wait(timeout=10)
            results[i] = RemoteReward(srv.url, timeout=20, retries=0)(images[i], None)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        stats = RemoteReward(srv.url, timeout=5).health()["stats"]
    assert len(results) == n_clients
    assert stats["requests"] == n_clients and stats["samples"] == n_clients * per
    assert stats["batches"] < n_clients and stats["max_merged_requests"] >= 2  # merged
    assert len(calls) == stats["batches"] and max(calls) >= 2 * per
    for i in range(n_clients):  # each request got back its own slice of the merged batch
        local = reward(images[i], None)
        torch.testing.assert_close(results[i]["remote"], local["total"])
        torch.testing.assert_close(results[i]["brightness"], local["brightness"].float())


def test_merged_batch_respects_max_batch():
    sizes = []

    class Sizes(Reward):
        name = "sizes"

        def _score(self, batch, reasons):
            sizes.append(len(batch.valid_indices))
            return {self.name: torch.zeros(len(batch.valid_indices))}

    with RewardServer(ComposedReward({"sizes": (Sizes(), 1.0)}), LOOPBACK, 0, max_batch=4, max_wait_ms=200) as srv:
        threads = [threading.Thread(target=lambda: RemoteReward(srv.url, timeout=20)(u8_images(2), None))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert sum(sizes) == 12 and max(sizes) <= 4


# --------------------------------------------------------------------------------------------
# Bad payloads: 4xx with a message
# --------------------------------------------------------------------------------------------


def png_b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("body, headers, status, words", [
    (b"{not json", {"Content-Type": "application/json"}, 400, "not valid JSON"),
    (b"{}", {"Content-Type": "application/json"}, 400, "exactly one of"),
    (json.dumps({"images": ["@@@"]}).encode(), {"Content-Type": "application/json"}, 400, "base64"),
    (json.dumps({"images": [base64.b64encode(b"hello").decode()]}).encode(), {"Content-Type": "application/json"},
     400, "not a readable image"),
    (json.dumps({"images": "x"}).encode(), {"Content-Type": "application/json"}, 400, "non-empty list"),
    (json.dumps({"array": {"shape": [1, 3, 2, 2], "dtype": "uint8", "data": base64.b64encode(b"123").decode()}}).encode(),
     {"Content-Type": "application/json"}, 400, "needs 12"),
    (json.dumps({"array": {"shape": [1, 4, 2, 2], "dtype": "uint8", "data": ""}}).encode(),
     {"Content-Type": "application/json"}, 400, "[N, 3, H, W]"),
    (json.dumps({"array": {"shape": [1, 3, 2, 2], "dtype": "float64", "data": ""}}).encode(),
     {"Content-Type": "application/json"}, 400, "dtype"),
    (bytes(12), {"Content-Type": "application/octet-stream"}, 400, "X-Image-Shape"),
    (bytes(12), {"Content-Type": "application/octet-stream", "X-Image-Shape": "1,3,2", "X-Image-Dtype": "uint8"},
     400, "four"),
    (bytes(11), {"Content-Type": "application/octet-stream", "X-Image-Shape": "1,3,2,2", "X-Image-Dtype": "uint8"},
     400, "11 bytes"),
    (b"pickle-ish", {"Content-Type": "application/python-pickle"}, 415, "Content-Type"),
    (b"[1, 2]", {"Content-Type": "application/json"}, 400, "must be an object, got list"),  # was a 500 retried
    (b"null", {"Content-Type": "application/json"}, 400, "must be an object, got NoneType"),
])
def test_bad_payloads_get_4xx_with_message(server, body, headers, status, words):
    code, answer = post(server.url + "/score", body, headers)
    assert code == status
    assert words in answer["error"]


def test_bad_side_lists_and_sizes(server):
    image = png_b64(to_pils(u8_images(1))[0])
    code, answer = post(server.url + "/score", json.dumps({"images": [image, image], "prompts": ["a"]}).encode(),
                        {"Content-Type": "application/json"})
    assert code == 400 and "2 images but 1 prompts" in answer["error"]
    code, answer = post(server.url + "/score", json.dumps({"images": [image], "metadata": [3]}).encode(),
                        {"Content-Type": "application/json"})
    assert code == 400 and "metadata" in answer["error"]
    code, answer = post(server.url + "/score", json.dumps({"images": [image], "extra": 1}).encode(),
                        {"Content-Type": "application/json"})
    assert code == 400 and "unknown fields" in answer["error"]


def test_oversized_body_is_413(pixel_reward):
    with RewardServer(pixel_reward, LOOPBACK, 0, max_request_mb=0.01) as srv:
        code, answer = post(srv.url + "/score", bytes(3 * 64 * 64 * 3),
                            {"Content-Type": "application/octet-stream", "X-Image-Shape": "3,3,64,64",
                             "X-Image-Dtype": "uint8"})
    assert code == 413 and "limit" in answer["error"]


def test_client_does_not_retry_a_4xx(server):
    client = RemoteReward(server.url, timeout=5, retries=3, backoff=5.0)
    start = time.monotonic()
    with pytest.raises(RewardServerError, match=r"refused the request: HTTP 400.*2 images but 1 prompts"):
        client._request("/score", json.dumps({"images": [png_b64(to_pils(u8_images(1))[0])] * 2,
                                              "prompts": ["a"]}).encode(), {"Content-Type": "application/json"})
    assert time.monotonic() - start < 4.0  # no backoff sleeps


def test_failing_reward_is_a_server_error_not_a_hang():
    class Broken(Reward):
        name = "broken"

        def _score(self, batch, reasons):
            raise RuntimeError("model exploded")

    with RewardServer(ComposedReward({"broken": (Broken(), 1.0)}), LOOPBACK, 0) as srv:
        client = RemoteReward(srv.url, timeout=5, retries=1, backoff=0.05)
        with pytest.raises(RewardServerError, match="HTTP 500.*model exploded"):
            client(u8_images(2), None)
        assert client.health()["status"] == "ok"  # the server survives


def test_client_argument_checks():
    with pytest.raises(ValueError, match="http://host:port"):
        RemoteReward("localhost:8000")
    with pytest.raises(ValueError, match="wire_dtype"):
        RemoteReward("http://127.0.0.1:1", wire_dtype="float64")


# --------------------------------------------------------------------------------------------
# A dead server: clear error within the timeout (server as a real `mmrl serve-rewards` process)
# --------------------------------------------------------------------------------------------


def start_cli_server(tmp_path, *extra):
    config = tmp_path / "serve.yaml"
    config.write_text("rewards:\n  brightness: 1.0\n  jpeg_compressibility: {weight: 0.5}\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "mmrl.cli", "serve-rewards", str(config), "--host", LOOPBACK,
                             "--port", "0", "--log-level", "warning", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 90
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if "serving rewards" in line:
            url = line.split(" on ")[1].split()[0]
            assert url.startswith(f"http://{LOOPBACK}:")
            return proc, url
    proc.kill()
    raise AssertionError(f"server did not start: {''.join(seen)}")


def test_killed_server_gives_clear_error_within_timeout(tmp_path):
    proc, url = start_cli_server(tmp_path)
    try:
        client = RemoteReward(url, timeout=2, retries=2, backoff=0.1)
        x = u8_images(3)
        local = build_rewards({"brightness": 1.0, "jpeg_compressibility": {"weight": 0.5}})(x, None)
        torch.testing.assert_close(client(x, None)["remote"], local["total"])
        proc.kill()
        proc.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(RewardServerError) as err:
            client(x, None)
        elapsed = time.monotonic() - start
        assert url in str(err.value) and "last failure" in str(err.value) and "3 attempt" in str(err.value)
        assert elapsed < 3 * 2 + 0.1 + 0.2 + 2  # (retries + 1) * timeout + backoffs, with slack
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_hung_server_times_out_with_clear_error(tmp_path):
    proc, url = start_cli_server(tmp_path)
    try:
        client = RemoteReward(url, timeout=1.0, retries=1, backoff=0.1)
        client.health()
        os.kill(proc.pid, signal.SIGSTOP)  # alive, accepting connections in the kernel, never answering
        start = time.monotonic()
        with pytest.raises(RewardServerError, match="timeout") as err:
            client(u8_images(2), None)
        assert url in str(err.value)
        assert time.monotonic() - start < 2 * 1.0 + 0.1 + 2
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


def test_wait_ready_and_check_fail_fast_on_nothing_listening():
    import socket

    with socket.socket() as s:  # a port with nothing listening
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(RewardServerError, match=f"{LOOPBACK}:{port}/health"):
        RemoteReward(f"http://{LOOPBACK}:{port}", timeout=1, retries=1, backoff=0.05, check=True)
    with pytest.raises(RewardServerError):
        RemoteReward(f"http://{LOOPBACK}:{port}", timeout=1, retries=0).wait_ready(timeout=0.5, interval=0.1)
    assert time.monotonic() - start < 5


def test_load_reward_spec(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("train: {steps: 2}\nrewards: {brightness: 1.0}\n")
    assert load_reward_spec(str(config)) == {"brightness": 1.0}
    assert load_reward_spec(rewards="{jpeg_compressibility: 2}") == {"jpeg_compressibility": 2}
    (tmp_path / "none.yaml").write_text("train: {steps: 2}\n")
    with pytest.raises(ValueError, match="rewards"):
        load_reward_spec(str(tmp_path / "none.yaml"))
    with pytest.raises(ValueError, match="either"):
        load_reward_spec(str(config), "{a: 1}")


# --------------------------------------------------------------------------------------------
# The startup probe (`mmrl train` / `mmrl score` check remote rewards before loading a model)
# --------------------------------------------------------------------------------------------


def _dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def test_probe_answers_on_a_live_server(server):
    info = RemoteReward(server.url, timeout=5).probe()
    assert info["status"] == "ok" and "brightness" in info["rewards"]


def test_probe_fails_fast_in_one_message_on_nothing_listening(caplog):
    port = _dead_port()
    remote = RemoteReward(f"http://{LOOPBACK}:{port}", timeout=120, retries=1, backoff=0.05)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="mmrl.rewards.remote"):
        with pytest.raises(RewardServerError, match=rf"{LOOPBACK}:{port}/health failed 2 attempt.*checked at startup"):
            remote.probe()
    assert time.monotonic() - start < 5
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # the error says it all
    assert remote.timeout == 120  # the probe's shorter timeout is not kept


def test_probe_with_startup_wait_waits_for_a_server_that_starts_late(pixel_reward):
    late = RewardServer(pixel_reward, LOOPBACK, 0)  # the port is bound but nothing answers yet
    timer = threading.Timer(0.5, late.start)
    timer.start()
    try:
        info = RemoteReward(late.url, retries=0, startup_wait=30).probe()
        assert info["status"] == "ok"
    finally:
        timer.join()
        late.stop()
    with pytest.raises(ValueError, match="startup_wait"):
        RemoteReward(late.url, startup_wait=-1)
    check_reward_arguments("remote", {"url": "http://h:1", "startup_wait": 60})


def test_probe_rejects_a_server_that_is_not_an_mmrl_reward_server():
    remote = RemoteReward(f"http://{LOOPBACK}:1", retries=0)
    remote.health = lambda: {"hello": "world"}
    with pytest.raises(RewardServerError, match="did not answer like an mmrl reward server"):
        remote.probe()


def test_remote_rewards_are_found_inside_compositions_and_routes():
    from mmrl.rewards.remote import find_remote_rewards, probe_remote_rewards

    port = _dead_port()
    url = f"http://{LOOPBACK}:{port}"
    composed = build_rewards({
        "brightness": 1.0,
        "judge": {"reward": "remote", "kwargs": {"url": url, "retries": 0}},
        "routed": {"reward": "task_routed", "kwargs": {"routes": {
            "grounding": {"remote": {"weight": 1.0, "kwargs": {"url": url + "/", "retries": 0}}}}}},
    })
    found = find_remote_rewards(composed)
    assert [key for key, _ in found] == ["judge", "routed.remote"]
    assert all(isinstance(r, RemoteReward) for _, r in found)
    with pytest.raises(RewardServerError, match=rf"^rewards\.judge: reward server {url}/health"):
        probe_remote_rewards(composed)
    assert probe_remote_rewards(build_rewards({"brightness": 1.0})) == 0


@pytest.mark.parametrize("answer, words", [
    ({"scores": {"total": ["high", 0.5]}}, "returned 'total' with values that are not numbers or null, e.g. 'high'"),
    ({"scores": {"total": [True, 0.5]}}, "not numbers or null, e.g. True"),
    ([1, 2], "answered without scores: [1, 2]"),
    ({"scores": {"total": [1.0, 0.5]}, "nan_samples": {"x": "why"}}, "nan_samples that are not a mapping"),
    ({"scores": {"total": [1.0, 0.5]}, "nan_samples": [0]}, "nan_samples that are not a mapping"),
])
def test_a_malformed_score_answer_is_one_clear_error(answer, words):
    """A server answering a string score or a JSON list: a RewardServerError naming the server, not a ValueError or
    AttributeError from inside the client."""
    remote = RemoteReward(f"http://{LOOPBACK}:1", retries=0)
    remote._request = lambda path, body, headers: answer
    with pytest.raises(RewardServerError) as err:
        remote._post_score(b"", {}, 2)
    assert words in str(err.value) and f"http://{LOOPBACK}:1" in str(err.value)


def test_a_non_finite_text_score_is_a_counted_nan():
    """The text path counted a server's Infinity / NaN score neither as NaN nor in last_info (the image path did)."""
    remote = RemoteReward(f"http://{LOOPBACK}:1", retries=0)
    remote._request = lambda path, body, headers: {"scores": {"total": [float("inf"), 1.0, None]}}
    out = remote(["a", "b", "c"], None, None)
    assert math.isnan(out["remote"][0]) and out["remote"][1] == 1.0 and math.isnan(out["remote"][2])
    assert set(remote.last_info["nan_samples"]) == {0, 2}


class _BadAnswer(http.server.BaseHTTPRequestHandler):
    """A fake reward server: 'cut' promises 500 bytes, sends 26 and closes; 'trickle' sends a byte every 0.4 s."""

    mode = "cut"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b'{"scores": {"total": [1.0]}}' + b" " * 200
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "500" if self.mode == "cut" else str(len(body)))
        self.end_headers()
        if self.mode == "cut":
            self.wfile.write(body[:26])
            return
        try:
            for i in range(len(body)):
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
                time.sleep(0.4)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
            pass

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("mode, words", [("cut", "IncompleteRead"), ("trickle", "still arriving")])
def test_a_cut_or_trickling_answer_is_a_clear_error_within_the_timeout(mode, words):
    handler = type("Handler", (_BadAnswer,), {"mode": mode})
    httpd = http.server.ThreadingHTTPServer((LOOPBACK, 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        client = RemoteReward(f"http://{LOOPBACK}:{httpd.server_address[1]}", timeout=1.0, retries=1, backoff=0.1)
        start = time.monotonic()
        with pytest.raises(RewardServerError, match=words):
            client(["a"], None, None)
        assert time.monotonic() - start < 2 * (2 * 1.0 + 0.5) + 0.1 + 1  # two attempts, each ~2 timeouts at most
    finally:
        httpd.shutdown()
        httpd.server_close()
