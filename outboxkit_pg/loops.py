"""The event loop an async resource belongs to, and closing it from blocking code.

The asyncio side's pool and ``LISTEN`` connections live on the event loop that first used them
(psycopg_pool's tasks, the sockets' readers). ``PostgresStore.close()`` is blocking and may be
called from anywhere: from another thread while that loop runs, after ``asyncio.run`` has
ended it, or from blocking code inside it. ``close_from_blocking`` does what each allows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg

__all__ = ["close_from_blocking", "finish", "running_loop"]

log = logging.getLogger("outboxkit")

_CLOSING: set[asyncio.Task[None]] = set()  # closes scheduled on a running loop, kept alive


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def finish(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close ``conn``'s socket at once, without its event loop (which may be gone)."""
    if not conn.closed:
        conn.pgconn.finish()


def close_from_blocking(
    loop: asyncio.AbstractEventLoop | None,
    aclose: Callable[[], Coroutine[Any, Any, None]],
    hard: Callable[[], None],
    *,
    timeout: float = 5.0,
) -> None:
    """Run ``aclose()`` on ``loop`` from blocking code, wherever that loop is; ``hard()``
    (closing the sockets themselves) where it cannot be awaited.

    - no loop, or a closed one: nothing of it runs any more: ``hard()``;
    - running in another thread: ``aclose()`` runs there; this thread waits up to ``timeout``
      seconds, then closes the sockets anyway;
    - running in this thread (blocking code called from a coroutine): it cannot wait for
      itself, so ``aclose()`` is scheduled on it and runs at the loop's next turn;
    - at rest: ``aclose()`` runs on it, here.
    """
    if loop is None or loop.is_closed():
        hard()
        return
    if running_loop() is loop:
        task = loop.create_task(aclose())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)
        return
    if loop.is_running():
        future = asyncio.run_coroutine_threadsafe(aclose(), loop)
        try:
            future.result(timeout)
        except TimeoutError:
            log.warning("closing the asyncio side took over %g s: closing its sockets", timeout)
            hard()
        except Exception as exc:  # its loop stopped meanwhile; the close was cancelled
            log.debug("closing the asyncio side on its loop failed: %s", exc)
            hard()
        return
    try:
        loop.run_until_complete(aclose())
    except (Exception, asyncio.CancelledError) as exc:  # the loop started elsewhere meanwhile
        log.debug("closing the asyncio side on its loop failed: %s", exc)
        hard()
