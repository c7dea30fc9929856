"""Stop signals shared by ``mmrl train``, ``mmrl sft`` and ``mmrl pretrain``.

SIGINT / SIGTERM (Ctrl-C, a cluster preemption) ask a training loop to stop at its next safe point with a
checkpoint; a second SIGINT while stopping interrupts at once (``KeyboardInterrupt``). Each loop keeps its own
state (``stop_signal``) and its own message; this module only installs and restores the handlers.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["install_stop_signals", "signal_exit_code"]


def install_stop_signals(on_signal: Callable[[str], None], is_stopping: Callable[[], bool]) -> Callable[[], None]:
    """Handle SIGINT and SIGTERM: ``on_signal(name)`` (``"SIGINT"`` / ``"SIGTERM"``) records the request and says
    so; when ``is_stopping()`` is already true a SIGINT raises ``KeyboardInterrupt`` instead. Returns a function
    that puts the previous handlers back. Off the main thread (where handlers cannot be set) nothing is installed
    and the restore function does nothing."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        if is_stopping() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        on_signal(signal.Signals(signum).name)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def signal_exit_code(name: str) -> int:
    """The exit code of a run stopped by signal ``name``: 128 + its number (``"SIGTERM"`` -> 143); 130 for a name
    that is not a signal's."""
    import signal

    try:
        return 128 + int(signal.Signals[str(name)])
    except KeyError:
        return 130
