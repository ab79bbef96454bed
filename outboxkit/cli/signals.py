"""SIGTERM and SIGINT routed to a handler of the command's own while it runs."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["stop_signals"]


@contextmanager
def stop_signals(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """Route SIGTERM and SIGINT to ``handler`` (main thread only), restoring them afterwards.

    Installed whatever the process inherited: a command started in the background of a
    non-interactive shell inherits SIGINT ignored, and must stop on it all the same."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
