"""Aiming a drain (``topics=``, ``handlers=``, ``limit=``) and injecting crashes into it.

``AimedStore`` stands in front of the test store for one drain and changes nothing of the
production path but two things a test asks for:

- what a claim returns: the store claims as always, and the claims the drain is not aimed at
  (another topic, past ``limit``) are released at once, untouched (``Store.release``), so a
  round delivers only the events aimed at;
- where the process "crashes" (``CrashAt``): an ``InjectedCrash`` raised inside a delivery's
  transaction once its handler ran (``before_commit``: the transaction rolls back), or once it
  committed and before the round's settlement (``after_commit``); or the store's token fence
  refusing a delivery whose lease ran out while its handler ran (``lease_lost``: its writes are
  rolled back, it is retried once the lease is over). The drain then goes on as a restarted
  poller would: the crashed event is claimed again once its lease has run out.

Everything else is the store's own (``__getattr__``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.model import Claim, Event
from ..errors import ConfigurationError, LeaseLostError
from ..hookspecs import hookimpl
from ..store import Store

__all__ = ["CRASH_POINTS", "AimedStore", "CrashAt", "InjectedCrash", "Selection", "crash_points"]

CRASH_POINTS = ("before_commit", "after_commit", "lease_lost", "stale_poller")
"""Where ``CrashAt`` strikes (see ``CrashAt``)."""


class InjectedCrash(BaseException):
    """The process "died" at a crash point the test chose (``CrashAt``). A ``BaseException``,
    as a real crash is no handler error: the poller lets it through and the events in hand keep
    their leases."""


@dataclass
class CrashAt:
    """A crash point for ``outbox_drain(crash_at=...)``.

    Points:
        ``before_commit``: the handler ran; the process dies before its delivery's transaction
            commits (its writes and record are rolled back; it runs again after the lease).
        ``after_commit``: the delivery committed (handler's writes and record); the process
            dies before the round's settlement (the event is claimed again after the lease, and
            a handler with a record is not run again).
        ``lease_lost``: the lease runs out while the handler runs and the store's fence refuses
            its record (its writes are rolled back; it runs again after the lease).
        ``stale_poller``: once the event is settled, a stale poller that claimed it before runs
            the handler again; the store's fence refuses its record.

    Args:
        point: one of ``CRASH_POINTS``.
        topic: only events of this topic (any when None).
        handler: only deliveries to this handler (any when None).
        times: how many times it strikes.
    """

    point: str
    topic: str | None = None
    handler: str | None = None
    times: int = 1
    struck: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.point not in CRASH_POINTS:
            raise ConfigurationError(
                f"crash point must be one of {', '.join(CRASH_POINTS)}, got {self.point!r:.80}"
            )
        if isinstance(self.times, bool) or not isinstance(self.times, int) or self.times < 1:
            raise ConfigurationError(f"times must be an integer >= 1, got {self.times!r}")

    def aims_at(self, event: Event, handler: str | None) -> bool:
        return (
            len(self.struck) < self.times
            and (self.topic is None or event.topic == self.topic)
            and (self.handler is None or handler == self.handler)
        )


@dataclass
class Selection:
    """What a drain is aimed at: events of ``topics``, or that one of ``handlers`` takes (None:
    all); at most ``limit`` claims."""

    topics: frozenset[str] | None = None
    limit: int | None = None
    handlers: frozenset[str] | None = None
    names_for: Callable[[str], tuple[str, ...]] | None = None
    taken: int = 0

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.taken >= self.limit

    def wants(self, event: Event) -> bool:
        if self.topics is not None and event.topic not in self.topics:
            return False
        if self.handlers is not None and self.names_for is not None:
            return not self.handlers.isdisjoint(self.names_for(event.topic))
        return True

    def why_not(self, event: Event) -> str | None:
        """Why the drain does not claim ``event`` (None: it may)."""
        if self.topics is not None and event.topic not in self.topics:
            return f"not aimed at: topic {event.topic!r} is not in topics={sorted(self.topics)}"
        if not self.wants(event):
            return f"not aimed at: no handler of handlers={sorted(self.handlers or ())} takes it"
        if self.exhausted:
            return f"limit={self.limit} reached"
        return None


class _HandlerSeen:
    """The handler each claimed event is running now (the ``outboxkit_handler_scope`` hook)."""

    def __init__(self) -> None:
        self.current: dict[int, str] = {}

    @hookimpl
    def outboxkit_handler_scope(
        self, event: Event, handler: str, attempt: int, batched: bool
    ) -> contextlib.AbstractContextManager[object] | None:
        self.current[event.id] = handler
        return None


class AimedStore:
    """The test store, as one aimed drain sees it (see the module docstring).

    Args:
        store: the test store.
        selection: what the drain is aimed at.
        crashes: the crash points to strike.
        on_lease_lost: called before a ``lease_lost`` refusal (the drain moves the clock past
            the lease, as the handler's long run would have).
    """

    def __init__(
        self,
        store: Store,
        selection: Selection,
        crashes: Sequence[CrashAt],
        on_lease_lost: Callable[[Claim], None],
    ) -> None:
        self.inner = store
        self.selection = selection
        self.crashes = list(crashes)
        self.seen = _HandlerSeen()
        self.stale: list[Claim] = []
        self.notes: list[str] = []  # lease_lost strikes, which end no poller
        self._on_lease_lost = on_lease_lost

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return repr(self.inner)

    # -- claims ---------------------------------------------------------------------------------

    def claim(self, *, batch_size: int, **kwargs: Any) -> list[Claim]:
        """Every claim the store gives (all that is due, so nothing aimed at hides behind what
        is not), the ones not aimed at released at once."""
        claims: list[Claim] = self.inner.claim(batch_size=100_000, **kwargs)
        kept: list[Claim] = []
        for claim in claims:
            if len(kept) < batch_size and self.selection.why_not(claim.event) is None:
                kept.append(claim)
                self.selection.taken += 1
        others = [c for c in claims if c not in kept]
        if others:
            self.inner.release(others, now=kwargs.get("now"))
        for claim in kept:
            for crash in self.crashes:
                if crash.point == "stale_poller" and crash.aims_at(claim.event, crash.handler):
                    crash.struck.append((claim.event.id, crash.handler or "?"))
                    self.stale.append(claim)
                    break
        return kept

    def async_store(self) -> Any:
        if self.crashes:
            raise ConfigurationError(
                "crash_at= strikes in the blocking poller's deliveries; an app with async def "
                "handlers is drained by the asyncio poller"
            )
        return _AimedAsync(self.inner.async_store(), self)

    # -- crashes --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def rounds(self, *, concurrency: int = 1) -> Iterator[Any]:
        with self.inner.rounds(concurrency=concurrency) as deliveries:
            yield _Deliveries(deliveries, self) if self.crashes else deliveries

    def delivery(self, claim: Claim, *, now: Any) -> contextlib.AbstractContextManager[Any]:
        return self.struck_delivery(self.inner.delivery, claim, now)

    @contextlib.contextmanager
    def struck_delivery(
        self, open_delivery: Callable[..., Any], claim: Claim, now: Any
    ) -> Iterator[Any]:
        """``open_delivery(claim, now=now)``, a crash point striking in it."""
        point = self._strikes(claim, ("before_commit", "lease_lost"))
        with open_delivery(claim, now=now) as tx:
            yield tx
            if point is not None and point.point == "before_commit":
                raise InjectedCrash(f"injected crash before the commit of event {claim.event.id}")
            if point is not None:
                self.notes.append(f"lease of event {claim.event.id} lost while its handler ran")
                self._on_lease_lost(claim)
                raise LeaseLostError(f"event {claim.event.id}: lease lost (injected)")
        point = self._strikes(claim, ("after_commit",))
        if point is not None:
            raise InjectedCrash(f"injected crash after the commit of event {claim.event.id}")

    def _strikes(self, claim: Claim, points: tuple[str, ...]) -> CrashAt | None:
        handler = self.seen.current.get(claim.event.id)
        for crash in self.crashes:
            if crash.point in points and crash.aims_at(claim.event, handler):
                crash.struck.append((claim.event.id, handler or "?"))
                return crash
        return None


class _Deliveries:
    """A round's deliveries whose ``delivery`` may crash (``AimedStore.struck_delivery``)."""

    def __init__(self, inner: Any, aimed: AimedStore) -> None:
        self.inner = inner
        self.aimed = aimed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def delivery(self, claim: Claim, *, now: Any) -> contextlib.AbstractContextManager[Any]:
        return self.aimed.struck_delivery(self.inner.delivery, claim, now)


class _AimedAsync:
    """The store's asyncio side, aimed as ``AimedStore`` is (claims only: crash points are the
    blocking poller's)."""

    def __init__(self, inner: Any, aimed: AimedStore) -> None:
        self.inner = inner
        self.aimed = aimed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def claim(self, *, batch_size: int, **kwargs: Any) -> list[Claim]:
        claims: list[Claim] = await self.inner.claim(batch_size=100_000, **kwargs)
        selection = self.aimed.selection
        kept: list[Claim] = []
        for claim in claims:
            if len(kept) < batch_size and selection.why_not(claim.event) is None:
                kept.append(claim)
                selection.taken += 1
        others = [c for c in claims if c not in kept]
        if others:
            await self.inner.release(others, now=kwargs.get("now"))
        return kept


def crash_points(crash_at: str | CrashAt | Sequence[str | CrashAt]) -> list[CrashAt]:
    """``crash_at=`` as ``CrashAt``s (a point's name strikes the first delivery)."""
    given = [crash_at] if isinstance(crash_at, str | CrashAt) else list(crash_at)
    return [CrashAt(c) if isinstance(c, str) else c for c in given]
