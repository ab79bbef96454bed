"""The delivery modes every check that asks for an ``outbox`` runs in.

A blocking mode hands the test an ``Outbox`` as an app makes it. An asyncio mode hands it an
``Outbox`` whose ``poller()`` is the asyncio poller (``Outbox.async_poller``) driven from the
test's blocking code, on one event loop per test, so that the same check, written once, holds
for both pollers:

- ``poller(**options).run_once()`` runs the asyncio poller's ``run_once`` on the test's loop.
  Called again from a blocking handler the asyncio poller runs in a worker thread (a second
  poller taking over a zombie's events), it runs on the same loop, which is free meanwhile.
- A blocking transactional handler is subscribed as an ``async def`` that calls it (the asyncio
  poller runs ``async def`` transactional handlers only); a blocking non-transactional one is
  kept as it is, and the asyncio poller runs it in a worker thread.
- At the end of the test the store's asyncio side is closed on that loop, then the loop.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from outboxkit import Event, EventBus, Outbox, PollReport
from outboxkit.aio import AsyncPoller
from outboxkit.bus import DeliveryContext, Handler, HandlerSpec
from outboxkit.calls import is_coroutine_function
from outboxkit.core.model import Claim
from outboxkit.core.options import TransactionMode

__all__ = ["MODES", "AsyncioBus", "AsyncioOutbox", "LoopRunner", "Mode"]

T = TypeVar("T")


@dataclass(frozen=True)
class Mode:
    """How the pollers of the ``outbox`` fixture deliver."""

    name: str
    transaction: TransactionMode
    concurrency: int | None = None
    """None: the blocking poller; else the asyncio poller with this ``concurrency``."""

    @property
    def asyncio(self) -> bool:
        return self.concurrency is not None


MODES = (
    Mode("per_event", "per_event"),
    Mode("per_batch", "per_batch"),
    Mode("asyncio", "per_event", 1),
    Mode("asyncio-per_batch", "per_batch", 1),
    Mode("asyncio-x4", "per_event", 4),
)
"""``[per_event]`` and ``[per_batch]`` on the blocking poller; ``[asyncio]``,
``[asyncio-per_batch]`` and ``[asyncio-x4]`` (four events of a batch delivered at once) on the
asyncio poller."""


class LoopRunner:
    """One event loop, made for a test and closed at its end, run from the test's thread.

    ``run(coro)`` runs ``coro`` to its end on the loop: from the thread that made the runner, by
    running the loop; from another thread (a worker thread of the asyncio poller, while the loop
    runs a poll), by handing it to the running loop and waiting.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._owner = threading.get_ident()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.get_ident() != self._owner:
            if not self.loop.is_running():
                coro.close()
                raise RuntimeError("the test's event loop is not running to take this call")
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        if self.loop.is_running():
            coro.close()
            raise RuntimeError(
                "a blocking call of the asyncio poller from code running on its event loop "
                "(an async def handler): it would wait for itself"
            )
        try:
            return self.loop.run_until_complete(coro)
        except (KeyboardInterrupt, SystemExit):
            # A KeyboardInterrupt from a handler ends the program's loop under asyncio.run:
            # its tasks cancelled (their cleanup run), the loop closed. So here; the next call
            # runs on a new loop, as a restarted poller would.
            self.close()
            self.loop = asyncio.new_event_loop()
            raise

    def close(self) -> None:
        """End the loop as ``asyncio.run`` does: cancel what is left, then close it."""
        try:
            self._cancel_pending()
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()

    def _cancel_pending(self) -> None:
        for _ in range(100):
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            if not pending:
                return
            for task in pending:
                task.cancel()
            try:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            except (KeyboardInterrupt, SystemExit):
                continue  # re-raised by a cancelled task finishing its cleanup: done with it
        raise RuntimeError("tasks of a poll kept the test's event loop busy through 100 rounds")


class BlockingAsyncPoller:
    """An ``AsyncPoller`` driven from blocking code on a ``LoopRunner``: ``run_once``,
    ``process`` and ``run_until_idle``, as ``Poller`` has them."""

    def __init__(self, poller: AsyncPoller, runner: LoopRunner) -> None:
        self.poller = poller
        self.runner = runner

    @property
    def options(self) -> Any:
        return self.poller.options

    def stop(self) -> None:
        self.poller.stop()

    def run_once(self) -> PollReport:
        return self.runner.run(self.poller.run_once())

    def process(self, claims: Sequence[Claim], *, claimed_at: datetime) -> PollReport:
        return self.runner.run(self.poller.process(claims, claimed_at=claimed_at))

    def run_until_idle(
        self,
        *,
        on_idle: Callable[[], bool] | None = None,
        on_round: Callable[[PollReport], None] | None = None,
    ) -> list[PollReport]:
        return self.runner.run(self.poller.run_until_idle(on_idle=on_idle, on_round=on_round))


class AsyncioOutbox(Outbox):
    """An ``Outbox`` whose ``poller()`` is its asyncio poller at the mode's concurrency, driven
    from blocking code (``BlockingAsyncPoller``)."""

    runner: LoopRunner
    concurrency: int

    def poller(self, *, waiter: Any = None, **options: Any) -> Any:
        return BlockingAsyncPoller(self.async_poller(**options), self.runner)

    def async_poller(
        self, *, concurrency: int | None = None, waiter: Any = None, **options: Any
    ) -> AsyncPoller:
        return super().async_poller(
            concurrency=self.concurrency if concurrency is None else concurrency,
            waiter=waiter,
            **options,
        )


class AsyncioBus(EventBus):
    """An ``EventBus`` that subscribes a blocking transactional handler as an ``async def``
    calling it, under the same name (``async def`` and non-transactional ones as they are)."""

    def subscribe(
        self,
        topic: str,
        handler: Handler,
        *,
        name: str | None = None,
        transactional: bool = True,
    ) -> HandlerSpec:
        if transactional is True and callable(handler) and not is_coroutine_function(handler):
            handler = _as_coroutine(handler)
        return super().subscribe(topic, handler, name=name, transactional=transactional)


def _as_coroutine(fn: Handler) -> Handler:
    @functools.wraps(fn)  # the same default name (module:qualname)
    async def run(event: Event, ctx: DeliveryContext) -> object:
        return fn(event, ctx)

    return run
