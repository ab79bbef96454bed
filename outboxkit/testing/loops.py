"""Running a drain's coroutines: on a loop of the drain's own, or refusing inside a running
one; and naming handlers in messages."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..bus import HandlerSpec
from ..errors import DrainError

if TYPE_CHECKING:
    from ..aio import AsyncPoller

__all__ = ["closing", "names", "on_a_loop_of_its_own", "refuse_running_loop"]

T = TypeVar("T")


def names(specs: Sequence[HandlerSpec]) -> str:
    shown = ", ".join(repr(spec.name) for spec in specs[:5])
    return shown + (f" and {len(specs) - 5} more" if len(specs) > 5 else "")


def refuse_running_loop(message: str) -> None:
    """Raise ``DrainError(message)`` when an event loop runs in this thread: a drain cannot run
    a loop of its own inside it (checked before any coroutine is made, so none is left
    unawaited)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise DrainError(message)


def on_a_loop_of_its_own(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` on a fresh event loop, closed before this returns. With a loop factory
    the runner sets no event loop for the thread: a loop the test set up stays its own."""
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        return runner.run(coroutine)


async def closing(poller: AsyncPoller, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``, then close the store's asyncio side: its connections belong to the loop
    they were opened on, which ends with this drain."""
    try:
        return await work
    finally:
        await poller.store.close()
