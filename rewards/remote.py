"""Rewards served over HTTP: a batching server (``mmrl serve-rewards``) and its client (``remote``).

Serve the rewards of a config on a machine with the reward models (its GPU), and score from the
trainer's machines::

    mmrl serve-rewards configs/gpu/sd35m_flow_grpo_pickscore.yaml --host 0.0.0.0 --port 8000

    rewards:
      remote: {kwargs: {url: "http://reward-host:8000", timeout: 120, retries: 2}}

The server is a Starlette app run by uvicorn (imported only when serving; the client needs nothing
but the standard library). It holds one :class:`~mmrl.rewards.compose.ComposedReward` and one
scoring thread: requests that arrive within ``max_wait_ms`` of each other are merged, up to
``max_batch`` samples, into one reward call, then split again.

Protocol (JSON errors are ``{"error": "message"}`` with a 4xx status for a bad request, 413 for a
body over the size limit, 503 when the queue is full, 500 when the reward itself failed):

``GET /health``
    ``{"status": "ok", "rewards": [component names], "weights": {...}, "keys": [output keys],
    "needs_prompts": bool, "max_batch": int, "stats": {"requests", "batches", "samples",
    "max_merged_requests"}}``.

``POST /score`` with one of three bodies (never pickle):

* ``application/json``, PNG images: ``{"images": [base64 PNG (or any format Pillow reads), ...],
  "prompts": [...] | null, "metadata": [{...}, ...] | null}``;
* ``application/json``, a raw array: ``{"array": {"shape": [N, 3, H, W], "dtype": "uint8" |
  "float32", "data": base64 of the C-order bytes}, "prompts": ..., "metadata": ...}``;
* ``application/octet-stream``, a raw array without base64: the headers ``X-Image-Shape: N,3,H,W``,
  ``X-Image-Dtype: uint8|float32`` and ``X-Json-Length: k``; the body is ``k`` bytes of UTF-8 JSON
  (``{"prompts": ..., "metadata": ...}``, may be empty when ``k = 0``) followed by the array bytes;
* text rewards (a vision-language policy's completions): ``{"completions": [str, ...], ...}``.

A uint8 array is read as ``x / 255``, a float32 one as is (values in [0, 1]), exactly like a local
reward call. The answer is ``{"scores": {key: [float | null, ...]}, "nan_samples": {"i": reason},
"merged_requests": k, "merged_samples": n}``: every output key of the composed reward (``total``,
each component, each component's extras), NaN sent as ``null``; when a text reward reports character spans (span-scoped
credit), also ``"spans": {key: [[[start, end], ...] | null, ...]}`` for ``total`` (the weighted sum's spans) and each
reporting component, which the client keeps in ``last_info["spans"]`` (its main score's) and
``last_info["component_spans"]``, so ``cspo`` / ``span_scoped`` scope a served reward as a local one.

The client, :class:`RemoteReward` (registered as ``remote``), sends a tensor batch as a raw array
(default uint8: ``round(x * 255)``, the quantisation PickScore, HPS and the JPEG rewards apply
anyway; ``wire_dtype="float32"`` sends exact floats) and a list of PIL images as PNG. Its main score
is the server's ``total``, the server's other keys come back as extras. A connection failure, a
timeout or a 5xx is retried ``retries`` times with exponential ``backoff``; after that, or at once
for a 4xx, it raises :class:`RewardServerError` naming the url and the last failure: a dead server
is an error within about ``(retries + 1) * timeout + backoff * (2 ** retries - 1)`` seconds (a
refused connection costs only the backoff sleeps: 3 s with the defaults), never a hang; a server that sends its
answer slowly (headers, then a byte at a time) or cuts it off is a failed attempt too, each attempt at most about
``2 * timeout``.

At startup (``mmrl train``, ``mmrl score``) every remote reward is probed with :meth:`RemoteReward.probe`
(one ``GET /health``, each attempt at most :data:`PROBE_TIMEOUT_S` seconds; with ``startup_wait: S`` it
polls for up to S seconds, for a server that is still loading its models) before the policy is loaded,
so a dead or wrong URL is a one-line error at once rather than after the model has loaded.
"""
from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import math
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ._base import ImageBatch, Reward, register_reward
from ._text import as_spans

__all__ = [
    "RemoteReward",
    "RewardServerError",
    "find_remote_rewards",
    "probe_remote_rewards",
    "RewardServer",
    "ScoringQueue",
    "create_app",
    "serve",
    "load_reward_spec",
    "encode_png",
    "decode_request",
]

log = logging.getLogger("mmrl.rewards.remote")

_DTYPES = {"uint8": (torch.uint8, 1), "float32": (torch.float32, 4)}

#: Longest wait for one attempt of the startup probe (:meth:`RemoteReward.probe`).
PROBE_TIMEOUT_S = 10.0


class RewardServerError(RuntimeError):
    """The reward server could not be reached, timed out, or refused the request."""


class BadRequest(ValueError):
    """A request the server cannot score (answered with a 4xx and this message)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------------------------
# Wire format (shared by server and client)
# --------------------------------------------------------------------------------------------


def encode_png(image) -> str:
    """One PIL image -> base64 PNG text (lossless)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _decode_image(text: Any, index: int):
    from PIL import Image

    if not isinstance(text, str):
        raise BadRequest(f"images[{index}] must be a base64 string, got {type(text).__name__}")
    try:
        data = base64.b64decode(text, validate=True)
    except Exception:
        raise BadRequest(f"images[{index}] is not valid base64") from None
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:
        raise BadRequest(f"images[{index}] is not a readable image ({type(exc).__name__}: {exc})") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def _parse_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, str):
        try:
            shape = [int(s) for s in shape.replace("x", ",").split(",") if s.strip()]
        except ValueError:
            raise BadRequest(f"image shape {shape!r} must be four integers N,3,H,W") from None
    if (not isinstance(shape, (list, tuple)) or len(shape) != 4
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise BadRequest(f"image shape must be four non-negative integers [N, 3, H, W], got {shape!r}")
    if shape[1] != 3:
        raise BadRequest(f"image shape must be [N, 3, H, W] (channels first, RGB), got {list(shape)}")
    if shape[0] == 0 or shape[2] == 0 or shape[3] == 0:
        raise BadRequest(f"image shape has an empty dimension: {list(shape)}")
    return tuple(shape)


def _array_from_bytes(data: bytes | memoryview, shape: Any, dtype: Any) -> torch.Tensor:
    shape = _parse_shape(shape)
    if dtype not in _DTYPES:
        raise BadRequest(f"image dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    torch_dtype, itemsize = _DTYPES[dtype]
    expected = math.prod(shape) * itemsize
    if len(data) != expected:
        raise BadRequest(f"image data has {len(data)} bytes; shape {list(shape)} of {dtype} needs {expected}")
    if torch_dtype == torch.uint8:  # read in place (no copy): the division makes the tensor the reward gets
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": it is never written
            array = torch.frombuffer(data, dtype=torch.uint8).reshape(shape)
        return array.float().div_(255.0)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)


@dataclass
class ScoreRequest:
    """One decoded request: a float tensor ``[N, 3, H, W]``, a list of RGB PIL images, or completions."""

    kind: str  # "tensor" | "pil" | "text"
    items: Any
    n: int
    prompts: list | None
    metadata: list | None
    future: Future = field(default_factory=Future)

    @property
    def group_key(self) -> tuple:
        if self.kind == "tensor":
            return ("tensor", tuple(self.items.shape[1:]))
        return (self.kind,)


def _check_side_lists(n: int, prompts: Any, metadata: Any, needs_prompts: bool) -> tuple[list | None, list | None]:
    if prompts is None:
        if needs_prompts:
            raise BadRequest("these rewards need one prompt per image: send \"prompts\": [...]")
    else:
        if not isinstance(prompts, list):
            raise BadRequest(f"prompts must be a list of strings, got {type(prompts).__name__}")
        if len(prompts) != n:
            raise BadRequest(f"got {n} images but {len(prompts)} prompts; they must match")
    if metadata is not None:
        if not isinstance(metadata, list):
            raise BadRequest(f"metadata must be a list of objects, got {type(metadata).__name__}")
        if len(metadata) != n:
            raise BadRequest(f"got {n} images but {len(metadata)} metadata entries; they must match")
        if not all(m is None or isinstance(m, dict) for m in metadata):
            raise BadRequest("metadata entries must be JSON objects (or null)")
        metadata = [m if m is not None else {} for m in metadata]
    return prompts, metadata


def decode_request(body: bytes, content_type: str, headers: Mapping[str, str], *, needs_prompts: bool,
                   max_samples: int | None = None) -> ScoreRequest:
    """A ``POST /score`` body -> :class:`ScoreRequest`; raises :class:`BadRequest` with the reason."""
    content_type = (content_type or "").split(";")[0].strip().lower()
    if content_type == "application/octet-stream":
        try:
            json_len = int(headers.get("x-json-length", "0"))
        except ValueError:
            raise BadRequest("X-Json-Length must be an integer") from None
        if not 0 <= json_len <= len(body):
            raise BadRequest(f"X-Json-Length={json_len} does not fit a body of {len(body)} bytes")
        if "x-image-shape" not in headers or "x-image-dtype" not in headers:
            raise BadRequest("a raw array body needs the headers X-Image-Shape (N,3,H,W) and X-Image-Dtype")
        payload = _load_json(body[:json_len]) if json_len else {}
        items = _array_from_bytes(memoryview(body)[json_len:], headers["x-image-shape"], headers["x-image-dtype"].strip())
        kind = "tensor"
    elif content_type in ("application/json", ""):
        payload = _load_json(body)
        if not isinstance(payload, dict):
            raise BadRequest(f"the JSON body must be an object, got {type(payload).__name__}")
        given = [k for k in ("images", "array", "completions") if payload.get(k) is not None]
        if len(given) != 1:
            raise BadRequest("send exactly one of \"images\" (base64 PNG list), \"array\" ({shape, dtype, data}) "
                             f"or \"completions\" (list of strings); got {given or 'none'}")
        if given[0] == "images":
            images = payload["images"]
            if not isinstance(images, list) or not images:
                raise BadRequest("images must be a non-empty list of base64-encoded PNG images")
            if max_samples is not None and len(images) > max_samples:
                raise BadRequest(f"{len(images)} images exceed this server's limit of {max_samples} per request", 413)
            items, kind = [_decode_image(t, i) for i, t in enumerate(images)], "pil"
        elif given[0] == "array":
            spec = payload["array"]
            if not isinstance(spec, dict) or not {"shape", "dtype", "data"} <= set(spec):
                raise BadRequest("array must be an object {\"shape\": [N, 3, H, W], \"dtype\": ..., \"data\": base64}")
            try:
                data = base64.b64decode(spec["data"], validate=True)
            except Exception:
                raise BadRequest("array.data is not valid base64") from None
            items, kind = _array_from_bytes(data, spec["shape"], spec["dtype"]), "tensor"
        else:
            items = payload["completions"]
            if not isinstance(items, list) or not items or not all(isinstance(c, str) for c in items):
                raise BadRequest("completions must be a non-empty list of strings")
            kind = "text"
    else:
        raise BadRequest(f"unsupported Content-Type {content_type!r}: use application/json or "
                         "application/octet-stream", 415)
    if not isinstance(payload, dict):
        raise BadRequest("the JSON body must be an object")
    unknown = set(payload) - {"images", "array", "completions", "prompts", "metadata"}
    if unknown:
        raise BadRequest(f"unknown fields {sorted(unknown)}; expected images | array | completions, prompts, metadata")
    n = items.shape[0] if kind == "tensor" else len(items)
    if max_samples is not None and n > max_samples:
        raise BadRequest(f"{n} samples exceed this server's limit of {max_samples} per request", 413)
    prompts, metadata = _check_side_lists(n, payload.get("prompts"), payload.get("metadata"),
                                          needs_prompts and kind != "text")
    return ScoreRequest(kind, items, n, prompts, metadata)


def _load_json(raw: bytes | memoryview) -> Any:
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None


def _jsonable(value: Any) -> Any:
    """``json.dumps`` fallback for metadata values: tensors and numpy arrays as lists, the rest as text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, default=_jsonable).encode("utf-8")


def _finite_or_none(values: torch.Tensor) -> list:
    return [v if math.isfinite(v) else None for v in values.tolist()]


# --------------------------------------------------------------------------------------------
# Server: a batching queue in front of one reward, and the HTTP app
# --------------------------------------------------------------------------------------------


def _nan_samples(info: Mapping) -> dict:
    """``{index: reason}`` from a reward's ``last_info`` (a ComposedReward nests it under ``total``)."""
    if "nan_samples" in info:
        return dict(info["nan_samples"])
    total = info.get("total")
    return dict(total.get("nan_samples", {})) if isinstance(total, Mapping) else {}


def _reported_spans(info: Mapping) -> dict[str, list]:
    """``{key: per-sample spans}`` from a ComposedReward's ``last_info``: ``total`` (the weighted sum's spans,
    :func:`~mmrl.rewards._text.combined_spans`) and each component that reports spans; empty when none does."""
    out = {key: comp["spans"] for key, comp in (info.get("components") or {}).items()
           if isinstance(comp, Mapping) and comp.get("spans") is not None}
    if info.get("spans") is not None:
        out["total"] = info["spans"]
    return out


class ScoringQueue:
    """Merges requests that arrive within ``max_wait_ms`` of the first, up to ``max_batch`` samples,
    and scores them in one call of ``reward`` on a single worker thread (the only thread that
    touches the reward, so the reward need not be thread-safe).

    Requests are merged only with compatible ones: tensors of one image size, PIL lists, text.
    If a merged call raises, each request is scored alone, so the error lands on the request that
    caused it. ``submit(request)`` returns the request's Future, resolved to
    ``(scores, nan_samples, spans, merged_requests, merged_samples)`` (``spans``: :func:`_reported_spans`).
    """

    def __init__(self, reward, *, max_batch: int = 64, max_wait_ms: float = 5.0, max_queue: int = 1024):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.reward = reward
        self.max_batch = int(max_batch)
        self.max_wait = max(0.0, float(max_wait_ms)) / 1000.0
        self._queue: queue.Queue[ScoreRequest | None] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "batches": 0, "samples": 0, "max_merged_requests": 0}

    def start(self) -> "ScoringQueue":
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="mmrl-reward-scorer", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        if self._thread is not None:
            self._thread.join(timeout)
        while True:  # fail what is still queued rather than leave callers waiting
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and not item.future.done():
                item.future.set_exception(RewardServerError("the reward server is shutting down"))

    def submit(self, request: ScoreRequest) -> Future:
        if self._stop.is_set():
            raise RewardServerError("the reward server is shutting down")
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            raise BadRequest("the scoring queue is full; retry later", 503) from None
        return request.future

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if first is None:
                break
            pending, count = [first], first.n
            deadline = time.monotonic() + self.max_wait
            while count < self.max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if item is None:
                    self._stop.set()
                    break
                pending.append(item)
                count += item.n
            groups: dict[tuple, list[ScoreRequest]] = {}
            for item in pending:
                groups.setdefault(item.group_key, []).append(item)
            for items in groups.values():
                chunk: list[ScoreRequest] = []
                size = 0
                for item in items:  # keep each merged call within max_batch (a lone big request goes alone)
                    if chunk and size + item.n > self.max_batch:
                        self._score(chunk)
                        chunk, size = [], 0
                    chunk.append(item)
                    size += item.n
                if chunk:
                    self._score(chunk)

    def _call(self, requests: list[ScoreRequest]) -> tuple[dict[str, torch.Tensor], dict, dict]:
        kind = requests[0].kind
        if kind == "tensor":
            images = torch.cat([r.items for r in requests]) if len(requests) > 1 else requests[0].items
        else:
            images = [x for r in requests for x in r.items]
        if all(r.prompts is None for r in requests):
            prompts = None
        else:
            prompts = [p for r in requests for p in (r.prompts if r.prompts is not None else [""] * r.n)]
        if all(r.metadata is None for r in requests):
            metadata = None
        else:
            metadata = [m for r in requests for m in (r.metadata if r.metadata is not None else [{}] * r.n)]
        scores = self.reward(images, prompts, metadata)
        info = getattr(self.reward, "last_info", {}) or {}
        return scores, _nan_samples(info), _reported_spans(info)

    def _score(self, requests: list[ScoreRequest]) -> None:
        requests = [r for r in requests if r.future.set_running_or_notify_cancel()]
        if not requests:
            return
        try:
            scores, reasons, spans = self._call(requests)
        except Exception as exc:
            if len(requests) > 1:  # find the culprit: score each on its own
                for r in requests:
                    self._score_alone(r)
                return
            self._fail(requests[0], exc)
            return
        total = sum(r.n for r in requests)
        with self._lock:
            self.stats["requests"] += len(requests)
            self.stats["batches"] += 1
            self.stats["samples"] += total
            self.stats["max_merged_requests"] = max(self.stats["max_merged_requests"], len(requests))
        start = 0
        for r in requests:
            part = {k: _finite_or_none(v.detach().to("cpu", torch.float32).reshape(-1)[start : start + r.n])
                    for k, v in scores.items()}
            nan = {str(i - start): why for i, why in reasons.items() if start <= int(i) < start + r.n}
            part_spans = {k: v[start : start + r.n] for k, v in spans.items()}
            r.future.set_result((part, nan, part_spans, len(requests), total))
            start += r.n

    def _score_alone(self, request: ScoreRequest) -> None:
        fresh = ScoreRequest(request.kind, request.items, request.n, request.prompts, request.metadata)
        fresh.future = Future()
        self._score([fresh])
        exc = fresh.future.exception()
        if exc is not None:
            request.future.set_exception(exc)
        else:
            request.future.set_result(fresh.future.result())

    @staticmethod
    def _fail(request: ScoreRequest, exc: Exception) -> None:
        if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, BadRequest):
            exc = BadRequest(f"the rewards rejected the batch: {exc}", 422)
        elif not isinstance(exc, BadRequest):
            log.exception("reward call failed", exc_info=exc)
        request.future.set_exception(exc)


def create_app(reward, *, max_batch: int = 64, max_wait_ms: float = 5.0, max_queue: int = 1024,
               max_request_mb: float = 512.0):
    """The Starlette app serving ``reward`` (a ComposedReward, or one reward, served as a composition of
    one so that ``total`` is always there); see the module doc.

    ``app.state.scoring`` is the :class:`ScoringQueue` (started and stopped with the app's lifespan).
    """
    import asyncio
    import contextlib

    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from .compose import ComposedReward

    if not isinstance(reward, ComposedReward):  # one bare reward: served as a composition of one (has "total")
        reward = ComposedReward({getattr(reward, "name", "reward"): (reward, 1.0)})
    scoring = ScoringQueue(reward, max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue)
    needs_prompts = bool(getattr(reward, "needs_prompts", True))
    max_bytes = int(max_request_mb * 1024 * 1024)
    weights = reward.all_weights

    def error(message: str, status: int) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({
            "status": "ok",
            "rewards": list(weights),
            "weights": weights,
            "main_key": getattr(reward, "name", "total"),
            "needs_prompts": needs_prompts,
            "max_batch": scoring.max_batch,
            "stats": dict(scoring.stats),
        })

    async def score(request: Request) -> JSONResponse:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return error(f"request body of {declared} bytes exceeds the limit of {max_bytes}", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                return error(f"request body exceeds the limit of {max_bytes} bytes", 413)
            chunks.append(chunk)
        body = b"".join(chunks)
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            item = await run_in_threadpool(decode_request, body, headers.get("content-type", ""), headers,
                                           needs_prompts=needs_prompts)
            scores, nan, spans, merged, merged_samples = await asyncio.wrap_future(scoring.submit(item))
        except BadRequest as exc:
            return error(str(exc), exc.status)
        except RewardServerError as exc:
            return error(str(exc), 503)
        except Exception as exc:  # the reward itself failed
            return error(f"scoring failed: {type(exc).__name__}: {exc}", 500)
        answer = {"scores": scores, "nan_samples": nan, "merged_requests": merged, "merged_samples": merged_samples}
        if spans:
            answer["spans"] = spans
        return JSONResponse(answer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scoring.start()
        try:
            yield
        finally:
            scoring.stop()

    app = Starlette(routes=[Route("/health", health, methods=["GET"]), Route("/score", score, methods=["POST"])],
                    lifespan=lifespan)
    app.state.scoring = scoring
    return app


class RewardServer:
    """Run the reward app with uvicorn in a background thread (tests, notebooks, one-process setups).

    ``RewardServer(reward, port=0).start()`` binds a free port; ``.url`` says where. ``stop()``
    shuts it down. ``mmrl serve-rewards`` runs the same app in the foreground (:func:`serve`).
    """

    def __init__(self, reward, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning", **app_kwargs):
        import uvicorn

        self.app = create_app(reward, **app_kwargs)
        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level=log_level, access_log=False,
                                lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "RewardServer":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="mmrl-reward-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RewardServerError(f"the reward server at {self.url} did not start within {timeout}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "RewardServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def load_reward_spec(config: str | None = None, rewards: str | Mapping | None = None) -> dict:
    """The ``rewards:`` mapping from a YAML config file (or a run folder's ``config.yaml``), or an inline YAML/JSON
    mapping (exactly one)."""
    import yaml

    if (config is None) == (rewards is None):
        raise ValueError("give either a config file (its `rewards:` mapping) or an inline --rewards mapping")
    if rewards is not None:
        where = "--rewards"
        try:
            spec = yaml.safe_load(rewards) if isinstance(rewards, str) else rewards
        except yaml.YAMLError as exc:
            raise ValueError(f"{where}: not a valid YAML/JSON mapping: {exc}") from None
    else:
        from pathlib import Path

        path = Path(config)
        if path.is_dir() and (path / "config.yaml").is_file():  # a run folder: the config it trained with
            path = path / "config.yaml"
        elif path.is_dir():
            raise FileNotFoundError(f"{path} is a folder without config.yaml: give a config file or a run folder")
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        spec = data.get("rewards") if isinstance(data, dict) else None
        where = f"{path}: rewards"
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"{where}: expected a non-empty mapping name -> weight | {{weight, kwargs, reward}}, "
                         f"got {spec!r}")
    return dict(spec)


def serve(reward, host: str = "127.0.0.1", port: int = 8000, *, max_batch: int = 64, max_wait_ms: float = 5.0,
          max_queue: int = 1024, max_request_mb: float = 512.0, log_level: str = "info") -> None:
    """Serve ``reward`` in the foreground until interrupted (what ``mmrl serve-rewards`` runs).

    ``port=0`` picks a free port. One line ``mmrl: serving rewards [...] on http://HOST:PORT`` is
    printed (flushed) once the socket listens.
    """
    import asyncio

    try:
        server = RewardServer(reward, host, port, log_level=log_level, max_batch=max_batch, max_wait_ms=max_wait_ms,
                              max_queue=max_queue, max_request_mb=max_request_mb)
    except OSError as exc:  # port taken, address not on this machine
        raise RewardServerError(f"cannot listen on {host}:{port}: {exc}") from None
    names = list(getattr(reward, "all_weights", None) or [getattr(reward, "name", "reward")])

    async def announce_and_serve():
        task = asyncio.ensure_future(server._server.serve(sockets=[server._sock]))
        while not server._server.started and not task.done():
            await asyncio.sleep(0.01)
        if server._server.started:
            print(f"mmrl: serving rewards {names} on {server.url} (POST /score, GET /health)", flush=True)
        await task

    try:
        asyncio.run(announce_and_serve())
    except KeyboardInterrupt:
        pass
    finally:
        server._sock.close()


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------


@register_reward("remote")
class RemoteReward(Reward):
    """Scores by calling a reward server (``mmrl serve-rewards``); see the module docstring.

    The main score (key ``remote``, or the name the reward is registered under) is the server's
    ``total``; every other key the server returns is an extra (``remote/pickscore`` in a composed
    reward). ``last_info`` carries the server's NaN reasons. Thread-safe apart from ``last_info``.
    """

    name = "remote"
    needs_prompts = False  # the server decides (and answers 400 when its rewards need prompts)
    scores_texts = True  # images or completions: the server decides

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 120.0,
        retries: int = 2,
        backoff: float = 1.0,
        wire_dtype: str = "uint8",
        image_format: str = "raw",
        check: bool = False,
        startup_wait: float = 0.0,
    ):
        """Args:
        url: the server, e.g. ``http://reward-host:8000`` (``/score`` and ``/health`` are appended).
        timeout: seconds for each attempt's connect and each read (a scoring call on a big batch
            counts as one read: set it above the server's worst batch time).
        retries: further attempts after a connection failure, a timeout or a 5xx (not after a 4xx).
        backoff: seconds before the first retry, doubled for each next one.
        wire_dtype: ``"uint8"`` (``round(x * 255)``, 4x smaller) or ``"float32"`` (exact) for tensors.
        image_format: ``"raw"`` (array bytes) or ``"png"`` for tensor batches; PIL lists always go as PNG.
        check: call ``/health`` now and raise :class:`RewardServerError` if the server is not there.
        startup_wait: seconds :meth:`probe` (the trainer's startup check) waits for a server that is not up
            yet; 0 = one check (with ``retries``).
        """
        super().__init__()
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"url must look like http://host:port, got {url!r}")
        if wire_dtype not in _DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(_DTYPES)}, got {wire_dtype!r}")
        if image_format not in ("raw", "png"):
            raise ValueError(f"image_format must be 'raw' or 'png', got {image_format!r}")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError("timeout must be > 0, retries and backoff >= 0")
        if not startup_wait >= 0:
            raise ValueError(f"startup_wait must be >= 0 seconds, got {startup_wait!r}")
        self.startup_wait = float(startup_wait)
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.wire_dtype = wire_dtype
        self.image_format = image_format
        # no proxies: a reward server is reached directly (and loopback must never go through one)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._probing = False  # the startup probe's failed attempts are logged at DEBUG: its error says it all
        if check:
            self.health()

    # ---- HTTP ----

    def _request(self, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None) -> dict:
        url = self.url + path
        attempts = self.retries + 1
        start = time.monotonic()
        last = "no attempt made"
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=body, headers=dict(headers or {}),
                                             method="POST" if body is not None else "GET")
            try:
                with self._opener.open(request, timeout=self.timeout) as response:
                    raw = self._read_body(response)
                return json.loads(raw.decode("utf-8"))
            except urllib.error.HTTPError as exc:
                try:
                    message = json.loads(exc.read().decode("utf-8")).get("error", "")
                except Exception:
                    message = ""
                last = f"HTTP {exc.code} {exc.reason}" + (f": {message}" if message else "")
                if exc.code < 500:
                    raise RewardServerError(f"reward server {url} refused the request: {last}") from None
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
                # refused, reset, timeout, bad JSON, a body cut off (IncompleteRead) or a status line that is none
                reason = getattr(exc, "reason", exc)
                last = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
                if isinstance(reason, (socket.timeout, TimeoutError)):
                    last = f"no answer within the {self.timeout:g}s timeout ({last})"
            log.log(logging.DEBUG if getattr(self, "_probing", False) else logging.WARNING,
                    "reward server %s: attempt %d/%d failed: %s", url, attempt + 1, attempts, last)
        raise RewardServerError(
            f"reward server {url} failed {attempts} attempt(s) over {time.monotonic() - start:.1f}s; "
            f"last failure: {last}. Is `mmrl serve-rewards` running there and reachable?"
        )

    def _read_body(self, response) -> bytes:
        """The answer's body, read as it arrives; a server still sending it ``timeout`` seconds after the headers
        (a byte at a time, each read within the socket timeout) is a timeout, so an attempt ends within about
        twice ``timeout``."""
        deadline = time.monotonic() + self.timeout
        chunks = []
        while True:
            chunk = response.read1(1 << 16)
            if not chunk:
                if getattr(response, "length", None):  # the connection closed short of its Content-Length
                    raise http.client.IncompleteRead(b"".join(chunks), response.length)
                return b"".join(chunks)
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the answer was still arriving {self.timeout:g}s after its headers")

    def health(self) -> dict:
        """The server's ``GET /health`` answer (reward names, weights, batching stats)."""
        return self._request("/health")

    def probe(self) -> dict:
        """The startup check: ``GET /health`` answers ``{"status": "ok", ...}`` (each attempt at most
        :data:`PROBE_TIMEOUT_S` seconds, ``retries`` retries; with ``startup_wait`` polled that long).
        Raises :class:`RewardServerError` saying what failed and how to start the server."""
        saved = self.timeout
        self.timeout = min(self.timeout, PROBE_TIMEOUT_S)
        self._probing = True
        try:
            info = self.wait_ready(self.startup_wait) if self.startup_wait > 0 else self.health()
        except RewardServerError as exc:
            raise RewardServerError(f"{exc} (checked at startup; the reward's kwargs startup_wait: SECONDS wait "
                                    f"for a server still loading its models)") from None
        finally:
            self.timeout = saved
            self._probing = False
        if not isinstance(info, dict) or info.get("status") != "ok":
            raise RewardServerError(f"{self.url}/health did not answer like an mmrl reward server: "
                                    f"{str(info)[:200]}")
        return info

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.2) -> dict:
        """Poll ``/health`` until the server answers (raises :class:`RewardServerError` after ``timeout``)."""
        deadline = time.monotonic() + timeout
        saved = self.retries, self.timeout
        self.retries, self.timeout = 0, min(self.timeout, max(interval, 1.0))
        try:
            while True:
                try:
                    return self.health()
                except RewardServerError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(interval)
        finally:
            self.retries, self.timeout = saved

    # ---- encoding ----

    def _encode_tensor(self, images: torch.Tensor, side: dict) -> tuple[bytes, dict]:
        images = images.detach().to("cpu")
        if self.image_format == "png":
            from ._images import tensor_to_pil

            payload = dict(side, images=[encode_png(img) for img in tensor_to_pil(images)])
            return _dumps(payload), {"Content-Type": "application/json"}
        if self.wire_dtype == "uint8":  # values are already in [0, 1] (prepare_batch clips them)
            array = images.float().mul(255).round_().clamp_(0, 255).to(torch.uint8)
        else:
            array = images.to(torch.float32)
        head = _dumps(side)
        body = b"".join((head, memoryview(array.contiguous().numpy()).cast("B")))
        return body, {
            "Content-Type": "application/octet-stream",
            "X-Image-Shape": ",".join(str(s) for s in array.shape),
            "X-Image-Dtype": self.wire_dtype,
            "X-Json-Length": str(len(head)),
        }

    def _post_score(self, body: bytes, headers: dict, n: int) -> tuple[dict[str, torch.Tensor], dict, dict]:
        answer = self._request("/score", body, headers)
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, dict) or "total" not in scores:
            raise RewardServerError(f"reward server {self.url} answered without scores: {str(answer)[:200]}")
        out = {}
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != n:
                raise RewardServerError(f"reward server {self.url} returned {key!r} with a wrong length")
            bad = [v for v in values if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
            if bad:
                raise RewardServerError(f"reward server {self.url} returned {key!r} with values that are not numbers "
                                        f"or null, e.g. {bad[0]!r}")
            out[key] = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float32)
        spans = answer.get("spans") or {}
        if not isinstance(spans, dict) or any(not isinstance(v, list) or len(v) != n for v in spans.values()):
            raise RewardServerError(f"reward server {self.url} returned spans that are not one list per sample")
        try:
            spans = {key: [as_spans(s) for s in per_sample] for key, per_sample in spans.items()}
        except (TypeError, ValueError):
            raise RewardServerError(f"reward server {self.url} returned malformed spans: {str(spans)[:200]}") from None
        reasons = answer.get("nan_samples") or {}
        try:
            reasons = {int(i): str(why) for i, why in reasons.items()}
        except (AttributeError, TypeError, ValueError):
            raise RewardServerError(f"reward server {self.url} returned nan_samples that are not a mapping of sample "
                                    f"index to reason: {str(reasons)[:200]}") from None
        return out, reasons, spans

    @staticmethod
    def _side(prompts, metadata) -> dict:
        side = {}
        if prompts is not None:
            side["prompts"] = list(prompts)
        if metadata is not None:
            side["metadata"] = [m if isinstance(m, dict) else None for m in metadata]
        return side

    # ---- scoring ----

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        from ._text import is_text_batch

        if isinstance(images, (list, tuple)) and images and is_text_batch(images):
            return self._score_text(list(images), prompts, metadata)
        return super().__call__(images, prompts, metadata)

    def _score_text(self, completions: list, prompts, metadata) -> dict[str, torch.Tensor]:
        body = _dumps(dict(self._side(prompts, metadata), completions=completions))
        scores, reasons, spans = self._post_score(body, {"Content-Type": "application/json"}, len(completions))
        total = scores.pop("total")
        for i in (~torch.isfinite(total)).nonzero().flatten().tolist():  # as the image path counts them
            reasons.setdefault(i, "the server returned no finite score")
        total = torch.where(torch.isfinite(total), total, torch.full_like(total, float("nan")))
        out = {self.name: total, **scores}
        from ._base import _info

        self.last_info = _info(len(completions), reasons)
        if "total" in spans:
            self.last_info["spans"] = spans.pop("total")
        if spans:
            self.last_info["component_spans"] = spans
        return out

    def _score(self, batch: ImageBatch, reasons: dict[int, str]) -> dict[str, torch.Tensor]:
        valid = batch.valid_indices
        prompts = None if batch.prompts is None else [batch.prompts[i] for i in valid]
        metadata = None if batch.metadata is None else [batch.metadata[i] for i in valid]
        side = self._side(prompts, metadata)
        if batch.is_tensor:
            (_, images), = batch.float_groups()
            body, headers = self._encode_tensor(images, side)
        else:
            body = _dumps(dict(side, images=[encode_png(img) for img in batch.pil()]))
            headers = {"Content-Type": "application/json"}
        scores, server_reasons, _ = self._post_score(body, headers, len(valid))
        for pos, why in server_reasons.items():
            if 0 <= pos < len(valid):
                reasons[valid[pos]] = f"server: {why}"
        return {self.name: scores.pop("total"), **scores}

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.url!r})"


def find_remote_rewards(reward, *, _path: str = "", _seen: set | None = None) -> list[tuple[str, RemoteReward]]:
    """Every :class:`RemoteReward` inside ``reward`` (a composition, task routes, a wrapping reward such as
    ``video_segmental``), as ``(dotted key, reward)``: ``[("remote", <RemoteReward>)]``."""
    seen = set() if _seen is None else _seen
    if id(reward) in seen:
        return []
    seen.add(id(reward))
    if isinstance(reward, RemoteReward):
        return [(_path or getattr(reward, "name", "remote"), reward)]
    found: list[tuple[str, RemoteReward]] = []
    if isinstance(reward, Mapping):
        for key, value in reward.items():
            found += find_remote_rewards(value, _path=f"{_path}.{key}" if _path else str(key), _seen=seen)
    elif isinstance(reward, (list, tuple)):
        for value in reward:
            found += find_remote_rewards(value, _path=_path, _seen=seen)
    elif type(reward).__module__.startswith("mmrl.rewards") and hasattr(reward, "__dict__"):
        for attr, value in vars(reward).items():  # only mmrl's own reward classes: never into models
            if isinstance(value, (Mapping, list, tuple)) or type(value).__module__.startswith("mmrl.rewards"):
                found += find_remote_rewards(value, _path=_path, _seen=seen)
    return found


def probe_remote_rewards(reward, where: str = "rewards") -> int:
    """:meth:`RemoteReward.probe` every remote reward in ``reward`` (see :func:`find_remote_rewards`); raises
    :class:`RewardServerError` naming the config key of the first unreachable one. Returns how many were probed."""
    remotes = find_remote_rewards(reward)
    for key, remote in remotes:
        try:
            remote.probe()
        except RewardServerError as exc:
            raise RewardServerError(f"{where}.{key}: {exc}") from None
    return len(remotes)
