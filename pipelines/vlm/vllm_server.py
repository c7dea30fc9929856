"""VLM rollouts on a vLLM server (``generation.vllm_server: URL``; ``mmrl vllm-serve CONFIG`` runs the server).

The colocated engine (:mod:`mmrl.pipelines.vlm.vllm_engine`) shares the training process and its devices. In server
mode vLLM runs in its own process, on its own devices or machine, as TRL's ``vllm_mode="server"`` (``trl
vllm-serve``): the training processes send it their prompts and the policy's weights over HTTP, and any number of
training processes (DDP / FSDP ranks, several nodes) sample from the one engine. The server is
:class:`~mmrl.pipelines.vlm.vllm_engine.VLLMSampler` behind a small HTTP front, so sampling is the colocated engine's
to the token: the same request seeds, end-of-turn tokens, suppressed vision placeholders and log-prob mode, and the
same check that the prompt vLLM expanded is the training processor's.

Weights travel as safetensors in the request body (chunks of at most ``chunk_mb``), the LoRA merged into copies as
in colocated mode. Which weights the engine holds is a fingerprint of the trained parameters (per tensor: its name,
shape, sum and sum of squares, in float64, hashed): before each rollout every process computes its own; the main
process (``RANK`` 0) pushes when the server's differs (after an optimizer step, a resume, swapped-in EMA weights, or
a restarted server), and the others wait until the server reports theirs, so no rank samples from weights it does
not hold. DDP replicas are bit-identical, so their fingerprints agree. This transfer (HTTP on any machine) is
mmrl's; TRL pushes over NCCL between GPUs, which is faster for large models and not built here.

Protocol (JSON, never pickle; arrays and images as base64 of their raw bytes, so pixels arrive exactly):

``GET /health``
    ``{"status": "ok", "model", "dtype", "max_model_len", "fingerprint": str | null, "pushes": int}``.
``POST /push`` (``application/octet-stream``, a safetensors file; header ``X-Weights-Fingerprint``)
    loads the tensors into the engine in place (``reload_weights``) and resets its prefix and encoder caches; the
    fingerprint is recorded once the header ``X-Weights-Final: 1`` arrives with the last chunk.
``POST /generate``
    ``{"prompts": [engine prompt, ...], "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "max_tokens", "stop_token_ids", "suppressed_ids", "seed", "greedy"}`` -> ``{"results": [[expanded prompt ids,
    [completion ids], [log-probs]], ...]}``.

Errors are ``{"error": message}`` with status 400 (a bad request) or 500 (the engine failed); the client raises
:class:`VLLMServerError` with the server's message.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import torch
from torch import Tensor

__all__ = ["VLLMServerClient", "VLLMServerError", "make_vllm_server", "serve_vllm", "launch_vllm_server",
           "weights_fingerprint", "encode_payload", "decode_payload"]

#: how often a waiting process asks the server which weights it holds
POLL_S = 0.05


class VLLMServerError(RuntimeError):
    """The vLLM server is unreachable, answered with an error, or holds other weights than expected."""


# ---------------------------------------------------------------------------------------------------- wire


def encode_payload(value: Any) -> Any:
    """JSON-ready form of an engine request: PIL images and numpy arrays become their raw bytes in base64 (with mode,
    size / dtype, shape), tuples are marked (vLLM reads a video as ``(frames, metadata)``), the rest as is."""
    import numpy as np
    from PIL import Image

    if isinstance(value, Image.Image):
        return {"__image__": {"mode": value.mode, "size": list(value.size),
                              "data": base64.b64encode(value.tobytes()).decode("ascii")}}
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return {"__array__": {"dtype": array.dtype.str, "shape": list(array.shape),
                              "data": base64.b64encode(array.tobytes()).decode("ascii")}}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_payload(v) for v in value]}
    if isinstance(value, list):
        return [encode_payload(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_payload(v) for k, v in value.items()}
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


def decode_payload(value: Any) -> Any:
    """Inverse of :func:`encode_payload`."""
    import numpy as np
    from PIL import Image

    if isinstance(value, list):
        return [decode_payload(v) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"__image__"}:
        spec = value["__image__"]
        return Image.frombytes(spec["mode"], tuple(spec["size"]), base64.b64decode(spec["data"]))
    if set(value) == {"__array__"}:
        spec = value["__array__"]
        data = base64.b64decode(spec["data"])
        return np.frombuffer(data, dtype=np.dtype(spec["dtype"])).reshape(spec["shape"]).copy()
    if set(value) == {"__tuple__"}:
        return tuple(decode_payload(v) for v in value["__tuple__"])
    return {k: decode_payload(v) for k, v in value.items()}


def weights_fingerprint(named: Iterable[tuple[str, Tensor]]) -> str:
    """Which weights these are, cheaply: a hash of each tensor's name, shape, sum (accumulated in float64) and sum of
    squares (a dot product), with no copy of any weight and one device-to-host copy for all. Bit-identical replicas
    give the same fingerprint; any optimizer step changes it."""
    names, stats = [], []
    for name, tensor in named:
        flat = tensor.detach().reshape(-1)
        names.append(f"{name}:{tuple(tensor.shape)}")
        stats.append(torch.stack([flat.sum(dtype=torch.float64), torch.dot(flat, flat).double()]))
    digest = hashlib.sha256("\n".join(names).encode())
    if stats:
        digest.update(torch.stack(stats).cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def _safetensors_chunks(weights: list[tuple[str, Tensor]], chunk_bytes: int) -> Iterable[bytes]:
    from safetensors.torch import save

    chunk: dict[str, Tensor] = {}
    size = 0
    for name, tensor in weights:
        tensor = tensor.detach().cpu().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield save(chunk)
            chunk, size = {}, 0
        chunk[name] = tensor
        size += nbytes
    yield save(chunk)


# ---------------------------------------------------------------------------------------------------- client


class VLLMServerClient:
    """The rollout engine of a training process in server mode: what
    :class:`~mmrl.pipelines.vlm.vllm_engine.VLLMSampler` does, over HTTP to ``mmrl vllm-serve``.

    Args:
        url: the server, ``http://host:port``.
        dtype: the policy's weight dtype (``model.dtype``); the server must run the same.
        max_model_len: prompt plus completion budget the policy needs; the server's must be at least this.
        timeout: seconds to wait for the server to come up, for one request, and for the main process's push.
        chunk_mb: the largest weight upload in one request.
        main_process: whether this process pushes the weights (default: ``RANK`` 0).
    """

    #: the policy pushes through :meth:`sync` (every process, every rollout), not through ``push`` alone
    syncs_weights = True

    def __init__(self, url: str, *, dtype: str, max_model_len: int, timeout: float = 600.0, chunk_mb: float = 256.0,
                 main_process: bool | None = None):
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.chunk_bytes = int(chunk_mb * 2**20)
        self.main_process = int(os.environ.get("RANK", "0")) == 0 if main_process is None else main_process
        self.pushes = 0
        self.waits = 0
        info = self.health(wait=True)
        if info.get("dtype") != dtype:
            raise VLLMServerError(f"the vLLM server at {self.url} runs {info.get('model')} in {info.get('dtype')}, "
                                  f"the policy is {dtype} (model.dtype): start it with the training config")
        if int(info.get("max_model_len", 0)) < max_model_len:
            raise VLLMServerError(
                f"the vLLM server at {self.url} takes {info.get('max_model_len')} tokens per sequence, the policy "
                f"needs {max_model_len} (generation.max_prompt_length + max_new_tokens): start it with the training "
                f"config")

    # ------------------------------------------------------------------------------------------------ http

    def _request(self, path: str, body: bytes | None = None, headers: dict | None = None,
                 timeout: float | None = None) -> dict:
        request = urllib.request.Request(self.url + path, data=body, headers=headers or {},
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", "")
            except Exception:  # noqa: BLE001 - not our JSON: report the status alone
                message = ""
            raise VLLMServerError(f"the vLLM server at {self.url} answered {path} with {exc.code}: "
                                  f"{message or exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise VLLMServerError(f"the vLLM server at {self.url} is unreachable ({reason}); start it with "
                                  f"`mmrl vllm-serve CONFIG --port PORT` (README: Rollouts on vLLM)") from None

    def health(self, *, wait: bool = False) -> dict:
        """The server's ``/health``; with ``wait`` retried until it answers or ``timeout`` passes."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self._request("/health", timeout=min(self.timeout, 10.0))
            except VLLMServerError:
                if not wait or time.monotonic() >= deadline:
                    raise
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------------------------------------ weights

    def push(self, weights: list[tuple[str, Tensor]], fingerprint: str | None = None) -> None:
        """Upload ``(checkpoint name, tensor)`` pairs (in chunks); the server loads them in place and drops its
        caches. ``fingerprint`` names the weights the engine holds once the last chunk is in."""
        chunks = _safetensors_chunks(weights, self.chunk_bytes)  # serialised one at a time: at most two held
        chunk = next(chunks)
        while chunk is not None:
            following = next(chunks, None)  # one ahead, to know which chunk is the last
            headers = {"Content-Type": "application/octet-stream"}
            if following is None:
                headers["X-Weights-Final"] = "1"
                if fingerprint is not None:
                    headers["X-Weights-Fingerprint"] = fingerprint
            self._request("/push", chunk, headers)
            chunk = following
        self.pushes += 1

    def sync(self, fingerprint: str, weights: Callable[[], list[tuple[str, Tensor]]]) -> None:
        """Make the engine hold the weights named ``fingerprint`` before this process samples: the main process
        pushes ``weights()`` when the server holds others; any other process waits until the server reports them."""
        held = self.health().get("fingerprint")
        if held == fingerprint:
            return
        if self.main_process:
            self.push(weights(), fingerprint)
            return
        self.waits += 1
        deadline = time.monotonic() + self.timeout
        while held != fingerprint:
            if time.monotonic() >= deadline:
                raise VLLMServerError(
                    f"the vLLM server at {self.url} still holds weights {held} after {self.timeout:.0f} s, this "
                    f"process's are {fingerprint}: the main process (RANK 0) pushes them before its rollout; are the "
                    f"processes training the same weights?")
            time.sleep(POLL_S)
            held = self.health().get("fingerprint")

    # ------------------------------------------------------------------------------------------------ sampling

    def generate(self, prompts: list[dict[str, Any]], *, n: int, temperature: float, top_p: float, top_k: int,
                 max_tokens: int, stop_token_ids: list[int], suppressed_ids: list[int], seed: int,
                 greedy: bool = False, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 ) -> list[tuple[list[int], list[list[int]], list[list[float]]]]:
        """As :meth:`VLLMSampler.generate <mmrl.pipelines.vlm.vllm_engine.VLLMSampler.generate>`, on the server."""
        payload = {"prompts": encode_payload(prompts), "n": n, "temperature": temperature, "top_p": top_p,
                   "top_k": top_k, "min_p": min_p, "repetition_penalty": repetition_penalty, "max_tokens": max_tokens,
                   "stop_token_ids": list(stop_token_ids), "suppressed_ids": list(suppressed_ids), "seed": seed,
                   "greedy": greedy}
        answer = self._request("/generate", json.dumps(payload).encode(), {"Content-Type": "application/json"})
        return [(list(ids), [list(c) for c in completions], [list(map(float, lp)) for lp in logps])
                for ids, completions, logps in answer["results"]]


# ---------------------------------------------------------------------------------------------------- server


class _Handler(BaseHTTPRequestHandler):
    server_version = "mmrl-vllm/1"
    engine: Any = None  # set by serve_vllm: the VLLMSampler
    info: dict = {}

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        pass

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path != "/health":
            return self._send(404, {"error": f"no route GET {self.path} (GET /health, POST /push, POST /generate)"})
        self._send(200, {"status": "ok", **self.info, "pushes": self.engine.pushes})

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if self.path == "/push":
                answer = self._push(body)
            elif self.path == "/generate":
                answer = self._generate(body)
            else:
                return self._send(404, {"error": f"no route POST {self.path}"})
        except (ValueError, KeyError, TypeError) as exc:
            return self._send(400, {"error": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:  # noqa: BLE001 - the engine failed: tell the client, keep serving
            return self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
        self._send(200, answer)

    def _push(self, body: bytes) -> dict:
        from safetensors.torch import load

        try:
            tensors = load(body)
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign body
            raise ValueError(f"the body is not a safetensors file ({exc})") from None
        self.info["fingerprint"] = None  # mixed weights until the last chunk is in
        self.engine.push(list(tensors.items()))
        if self.headers.get("X-Weights-Final") == "1":
            self.info["fingerprint"] = self.headers.get("X-Weights-Fingerprint")
        return {"loaded": len(tensors), "fingerprint": self.info["fingerprint"]}

    def _generate(self, body: bytes) -> dict:
        request = json.loads(body)
        prompts = decode_payload(request.pop("prompts"))
        if not isinstance(prompts, list) or not all(isinstance(p, dict) and "prompt_token_ids" in p for p in prompts):
            raise ValueError("prompts must be a list of {'prompt_token_ids': [...], 'multi_modal_data'?: {...}}")
        results = self.engine.generate(prompts, **request)
        return {"results": [[ids, completions, logps] for ids, completions, logps in results]}


def make_vllm_server(engine, *, host: str = "127.0.0.1", port: int = 8000, model: str = "", dtype: str = "",
                     max_model_len: int = 0) -> HTTPServer:
    """An HTTP server (listening, not yet serving) in front of ``engine``: a
    :class:`~mmrl.pipelines.vlm.vllm_engine.VLLMSampler`, or anything with its ``push`` / ``generate`` / ``pushes``.
    Requests are handled one at a time (the engine is not re-entrant); ``port=0`` picks a free port
    (``server.server_address[1]``)."""
    handler = type("Handler", (_Handler,), {"engine": engine, "info": {
        "model": model, "dtype": dtype, "max_model_len": int(max_model_len), "fingerprint": None}})
    try:
        return HTTPServer((host, port), handler)
    except OSError as exc:
        raise VLLMServerError(f"cannot listen on {host}:{port}: {exc}") from None


def serve_vllm(engine, *, host: str = "127.0.0.1", port: int = 8000, model: str = "", dtype: str = "",
               max_model_len: int = 0) -> None:
    """Serve ``engine`` (:func:`make_vllm_server`) in the foreground until interrupted (what ``mmrl vllm-serve``
    runs); one line ``mmrl: serving vLLM ... on http://HOST:PORT`` is printed once the socket listens."""
    server = make_vllm_server(engine, host=host, port=port, model=model, dtype=dtype, max_model_len=max_model_len)
    print(f"mmrl: serving vLLM ({model}, {dtype}, {max_model_len} tokens) on http://{host}:{server.server_address[1]} "
          f"(GET /health, POST /push, POST /generate)", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def launch_vllm_server(config: str, overrides: list[str] | tuple = (), *, host: str = "127.0.0.1", port: int = 0,
                       env: dict | None = None, timeout: float = 600.0):
    """Start ``mmrl vllm-serve CONFIG OVERRIDES`` in a subprocess (this Python) and wait until it listens. Returns
    ``(process, url)``; its output keeps being read in a daemon thread (so a full pipe never blocks it). Stop it with
    ``process.terminate()``. Raises :class:`VLLMServerError` with the last lines of its output if it exits or does
    not listen within ``timeout`` seconds."""
    import re
    import subprocess
    import sys
    import threading

    process = subprocess.Popen([sys.executable, "-m", "mmrl.cli", "vllm-serve", str(config), *overrides,
                                "--host", host, "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **(env or {})})
    lines: list[str] = []
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            lines.append(line)
            found = re.search(r"serving vLLM .* on (http://\S+)", line)
            if found:
                threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
                return process, found.group(1)
    finally:
        timer.cancel()
    process.wait()
    raise VLLMServerError(f"mmrl vllm-serve {config} exited with {process.returncode} before listening:\n"
                          + "".join(lines[-20:]))
