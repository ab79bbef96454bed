"""Calling a handler: which handlers a poller may run, the call itself (blocking, or awaited on
asyncio), and a relay's answers taken as its runs.

The two ``call`` functions are the one place where the pollers differ by more than waiting:
the blocking poller runs a handler as it is and refuses one that returns an awaitable; the
asyncio poller awaits an ``async def`` handler and runs a blocking one in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Sequence
from contextlib import AbstractContextManager

from .bus import DeliveryContext, HandlerSpec
from .context import Context
from .core.model import Event
from .core.text import storable
from .errors import ConfigurationError, Reject, RelayError
from .reports import NO_SCOPE, HandlerError

__all__ = [
    "MAX_CONCURRENCY",
    "async_handlers",
    "call",
    "call_async",
    "check_handlers",
    "is_coroutine_function",
    "reason_of",
    "relay_answers",
    "relayed",
    "relayed_async",
]

MAX_CONCURRENCY = 1_000
"""The most deliveries a poller may have in flight at once (``concurrency``)."""


def is_coroutine_function(fn: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def async_handlers(specs: Sequence[HandlerSpec]) -> list[HandlerSpec]:
    """The ``async def`` handlers among ``specs``, in order: a bus with any of them needs the
    asyncio poller (the test kit's drain and ``outboxkit run`` choose it by this).

    Args:
        specs: the subscriptions of a bus (``EventBus.specs()``).

    Returns:
        The subscriptions whose handler is an ``async def`` function (or callable object).
    """
    return [spec for spec in specs if is_coroutine_function(spec.fn)]


def check_handlers(specs: Sequence[HandlerSpec], *, asyncio: bool) -> None:
    """Refuse handlers a poller cannot run, naming them: an ``async def`` handler under the
    blocking poller (its coroutine would never be awaited), or (``asyncio``) a blocking
    transactional handler under the asyncio poller (it would block the event loop while it
    holds its delivery transaction).

    Raises:
        ConfigurationError: naming the handler and its topic.
    """
    for spec in specs:
        coroutine = is_coroutine_function(spec.fn)
        if coroutine and not asyncio:
            raise ConfigurationError(
                f"handler {spec.name!r} (topic {spec.topic!r}) is an async def: the blocking "
                "poller cannot await it; run it with outbox.async_poller()"
            )
        if asyncio and not coroutine and spec.transactional:
            raise ConfigurationError(
                f"handler {spec.name!r} (topic {spec.topic!r}) is a blocking transactional "
                "handler: the asyncio poller runs only async def transactional handlers (a "
                "blocking one would hold the event loop in its delivery transaction); make it "
                "async def, subscribe it with transactional=False, or use outbox.poller()"
            )


def reason_of(rejection: Reject) -> str:
    """A ``Reject``'s reason, storable (see ``core.text.storable``)."""
    return storable(rejection.reason)


# -- the call ---------------------------------------------------------------------------------------


def call(
    spec: HandlerSpec, event: Event, ctx: Context, around: AbstractContextManager[object]
) -> None:
    """Run the handler inside ``around`` (a handler scope: a tracing span, which sees the
    handler's own exception), then finish its session (its pending writes, before the
    record). A handler that returns an awaitable is refused: it is never recorded as run
    without running (its coroutine, if it is one, is closed unawaited).

    Raises:
        Reject: the handler rejected the event.
        HandlerError: the handler (or its session's flush) failed, or returned an awaitable.
    """
    try:
        if around is NO_SCOPE:
            result = spec.fn(event, ctx)
        else:
            with around:
                result = spec.fn(event, ctx)
        awaitable = result is not None and inspect.isawaitable(result)
        if ctx.scope is not None and not awaitable:
            ctx.scope.finish()
    except Reject:
        raise
    except Exception as exc:
        raise HandlerError(exc) from exc
    finally:
        if ctx.scope is not None:
            ctx.scope.close()
    if awaitable:
        if inspect.iscoroutine(result):
            result.close()  # no "never awaited" warning: it is reported here instead
        raise HandlerError(
            TypeError(
                f"handler {spec.name!r} returned {type(result).__name__}, an awaitable: the "
                "blocking poller cannot await it; run async handlers with outbox.async_poller()"
            )
        )


async def call_async(
    spec: HandlerSpec, event: Event, ctx: Context, around: AbstractContextManager[object]
) -> None:
    """``call`` on asyncio: an ``async def`` handler awaited, a blocking (non-transactional)
    one run in a worker thread, so that it does not hold the event loop; either inside
    ``around``, entered and left in this task.

    Raises:
        Reject: the handler rejected the event.
        HandlerError: the handler (or its session's flush) failed.
    """
    try:
        with around:
            if is_coroutine_function(spec.fn):
                result = spec.fn(event, ctx)
            else:
                result = await asyncio.to_thread(spec.fn, event, ctx)
            if inspect.isawaitable(result):
                await result  # a plain function that returns an awaitable: awaited too
        if ctx.scope is not None:
            await _settled(ctx.scope.finish())  # the session's pending writes, first
    except Reject:
        raise
    except Exception as exc:
        raise HandlerError(exc) from exc
    finally:
        if ctx.scope is not None:
            await _settled(ctx.scope.close())


async def _settled(result: object) -> None:
    """Await what a session scope returned, if it is awaitable (an asyncio session's)."""
    if inspect.isawaitable(result):
        await result


# -- relays ---------------------------------------------------------------------------------------


def relay_answers(spec: HandlerSpec, count: int, answers: object) -> list[Exception | None]:
    """What ``spec``'s relay answered for ``count`` events, checked: anything but a list of
    ``count`` entries, each ``None`` or an ``Exception``, fails every event, naming it (a
    relay's bug is never recorded as a delivery)."""
    if (
        isinstance(answers, list)
        and len(answers) == count
        and all(a is None or isinstance(a, Exception) for a in answers)
    ):
        return answers
    failure = RelayError(
        f"relay {spec.name!r} answered {type(answers).__name__} for {count} event(s); "
        "publish must return one None or Exception per event"
    )
    return [failure] * count


def relayed(spec: HandlerSpec, answer: Exception | None) -> HandlerSpec:
    """A relay's subscription as a blocking handler whose run is the broker's ``answer`` for
    one event: a confirm returns, anything else is raised; the poller then records it as any
    non-transactional handler's run."""

    def confirmed(event: Event, ctx: DeliveryContext) -> None:
        if answer is not None:
            raise answer

    return dataclasses.replace(spec, fn=confirmed)


def relayed_async(spec: HandlerSpec, answer: Exception | None) -> HandlerSpec:
    """``relayed`` as an ``async def`` handler, for the asyncio poller."""

    async def confirmed(event: Event, ctx: DeliveryContext) -> None:
        if answer is not None:
            raise answer

    return dataclasses.replace(spec, fn=confirmed)
