"""Score rewards in the background, overlapping with the next sampling batch.

::

    scorer = AsyncScorer(reward)                       # one worker thread, started on the first submit
    future = scorer.submit(images, prompts, metadata)  # returns at once
    next_images = policy.sample(...)                   # sampling runs meanwhile
    scores = future.result()                           # dict[str, Tensor], as reward(...) returns
    scores.info                                        # reward.last_info of that call (a copy)
    scorer.release()                                   # the worker thread ends (see release: OpenMP)

What overlaps: the reward's CPU work (tensor -> PIL, tokenising, JPEG encoding, HTTP round trips
to a reward server, Python overhead), which releases the GIL in PIL, torch and socket calls, with
the sampler's; and, on CUDA, the reward's kernels with the sampler's, because the worker runs on
its own CUDA stream (see below).

Thread safety:

* with ``max_workers=1`` (the default) the reward is called from one thread only, one batch after
  another in submission order, so no reward needs to be thread-safe. Each result carries a copy
  of ``reward.last_info`` taken right after its own call (``result.info``);
* ``max_workers > 1`` calls the reward concurrently: only for rewards that are thread-safe (a
  :class:`~mmrl.rewards.remote.RemoteReward`, several of which in flight let a batching server merge
  them; pure functions). ``result.info`` is then whatever ``last_info`` held after the call and may
  belong to another call of a reward that stores it on itself;
* the caller must not modify a submitted tensor in place until its future is done (pass
  ``copy=True`` to :meth:`AsyncScorer.submit` to hand over a private copy instead).

CUDA streams (when CUDA is initialised in the process): CUDA's current device is per thread, so
``submit`` captures the caller's (the images' device, else ``torch.cuda.current_device()``) and the
worker runs under it. A tensor on a CUDA device was written by kernels queued on the caller's
current stream. ``submit`` records an event on that stream; the worker, running on its own stream
(``torch.cuda.Stream`` per device, created lazily), waits for the event before touching the
tensor and marks it with ``record_stream`` so the caching allocator does not hand its memory to the
caller before the reward's kernels are done. The reward's outputs are CPU tensors (the contract),
so the results are complete when the future resolves. ``use_stream=False`` keeps the worker on the
device's default stream (kernels then serialise with the sampler's, CPU work still overlaps).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

__all__ = ["AsyncScorer", "ScoreResult"]


class ScoreResult(dict):
    """A reward's output dict (``{name: [N] tensor}``) with the call's ``info`` (``last_info``) and
    the seconds it took (``seconds``)."""

    info: dict
    seconds: float


class AsyncScorer:
    """Runs ``reward_fn(images, prompts, metadata)`` on worker threads; see the module docstring."""

    def __init__(self, reward_fn: Callable, max_workers: int = 1, *, use_stream: bool = True):
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.reward_fn = reward_fn
        self.max_workers = int(max_workers)
        self.use_stream = bool(use_stream)
        self._pool: ThreadPoolExecutor | None = None  # started on the first submit, ended by release()
        self._streams: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False

    @property
    def pending(self) -> int:
        """Submitted calls not finished yet."""
        return self._pending

    def _stream_for(self, device: torch.device):
        with self._lock:  # one side stream per device (and per scorer), created on first use
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]

    def submit(self, images: Any, prompts: Sequence[str] | None = None, metadata: Sequence[dict] | None = None,
               *, copy: bool = False) -> "Future[ScoreResult]":
        """Queue one reward call; returns a Future of its :class:`ScoreResult` (exceptions propagate
        through ``future.result()``)."""
        if self._closed:
            raise RuntimeError("AsyncScorer is closed")
        event = device = None
        if isinstance(images, torch.Tensor) and copy:
            images = images.detach().clone()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # the caller's device (CUDA's current device is per thread: the worker would see cuda:0)
            on_cuda = isinstance(images, torch.Tensor) and images.is_cuda
            device = images.device if on_cuda else torch.device("cuda", torch.cuda.current_device())
            if self.use_stream:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
        prompts = list(prompts) if prompts is not None else None
        metadata = list(metadata) if metadata is not None else None
        with self._lock:
            self._pending += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="mmrl-reward")
            pool = self._pool
        future = pool.submit(self._run, images, prompts, metadata, device, event)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: Future) -> None:
        with self._lock:
            self._pending -= 1

    def _run(self, images, prompts, metadata, device, event) -> ScoreResult:
        import time

        start = time.perf_counter()
        if device is None:
            scores = self.reward_fn(images, prompts, metadata)
        elif event is None:
            with torch.cuda.device(device):
                scores = self.reward_fn(images, prompts, metadata)
        else:
            stream = self._stream_for(device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                stream.wait_event(event)  # the images' producer kernels are done before we read them
                if isinstance(images, torch.Tensor) and images.is_cuda:
                    images.record_stream(stream)  # keep their memory until our kernels are done too
                scores = self.reward_fn(images, prompts, metadata)
                stream.synchronize()  # outputs are CPU tensors; make sure nothing is still queued
        result = ScoreResult(scores)
        result.info = dict(getattr(self.reward_fn, "last_info", {}) or {})
        result.seconds = time.perf_counter() - start
        return result

    def score(self, images: Any, prompts: Sequence[str] | None = None,
              metadata: Sequence[dict] | None = None) -> ScoreResult:
        """Synchronous convenience: ``submit(...).result()``."""
        return self.submit(images, prompts, metadata).result()

    def release(self) -> None:
        """Finish what was submitted, then let the worker threads end (the next :meth:`submit` starts new ones).

        The trainer calls this after each rollout's scores are in. A thread that ran torch ops on the CPU owns an
        OpenMP thread team for as long as it lives; while it does, OpenMP counts more threads than cores and every
        other thread's parallel regions stop spin-waiting and pay a wake-up per op (measured with 2 threads: a
        256 x 256 matmul + GELU loop on the main thread 2.3x slower while such a worker lives, 1.09x once it ended). An ended thread frees its team, so training runs as if no worker had
        existed."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def close(self, wait: bool = True) -> None:
        """Stop accepting work; ``wait=True`` finishes what was submitted first."""
        self._closed = True
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> "AsyncScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AsyncScorer({self.reward_fn!r}, max_workers={self.max_workers})"
