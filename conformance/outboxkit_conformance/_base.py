"""The base class every conformance test class derives from: fixtures and small helpers."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest

from outboxkit import Claim, EventBus, FrozenClock, ObserverEvent, Outbox, Store, hookimpl
from outboxkit.core.payload import build_event

__all__ = ["ConformanceBase", "Recorder", "StoreFactory", "call_factory"]

START = "2030-01-01T00:00:00Z"
LEASE = timedelta(seconds=30)

StoreFactory = Callable[..., "Store | AbstractContextManager[Store]"]
"""``factory()`` or ``factory(tmp_path)`` -> a fresh, empty, migrated store (or a context
manager yielding one, for stores that need cleanup such as dropping a schema)."""


def call_factory(factory: StoreFactory, tmp_path: Path) -> Store | AbstractContextManager[Store]:
    """Call ``factory`` with ``tmp_path`` if it takes an argument, else with none."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature
        params = {}  # type: ignore[assignment]
    required = [
        p
        for p in params.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return factory(tmp_path) if required else factory()


class Recorder:
    """An observer plugin that keeps every event it is sent."""

    def __init__(self) -> None:
        self.events: list[ObserverEvent] = []

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        self.events.append(event)

    def of(self, kind: type[ObserverEvent]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


class ConformanceBase:
    """Fixtures shared by every conformance test. Subclass ``StoreConformance`` instead.

    Subclasses provide :meth:`make_store`; they may set ``known_failures`` to a mapping of
    test name -> reason: those tests run as strict xfail (an unexpected pass fails the run).
    """

    known_failures: ClassVar[Mapping[str, str]] = {}

    def make_store(self, tmp_path: Path) -> Store | AbstractContextManager[Store]:
        """A fresh, empty, migrated store (or a context manager yielding one)."""
        raise NotImplementedError("subclasses of StoreConformance implement make_store(tmp_path)")

    # -- fixtures ---------------------------------------------------------------------------------

    @pytest.fixture
    def clock(self) -> FrozenClock:
        return FrozenClock(START)

    @pytest.fixture
    def store(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
        reason = self._known_failures().get(
            request.node.originalname
        ) or self._known_failures().get(request.node.name)
        if reason:
            request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
        made = self.make_store(tmp_path)
        if isinstance(made, AbstractContextManager):
            with made as store:
                yield store
        else:
            try:
                yield made
            finally:
                made.close()

    def _known_failures(self) -> Mapping[str, str]:
        return self.known_failures

    @pytest.fixture
    def bus(self) -> EventBus:
        return EventBus()

    @pytest.fixture
    def recorder(self) -> Recorder:
        return Recorder()

    @pytest.fixture
    def outbox(self, store: Store, bus: EventBus, clock: FrozenClock, recorder: Recorder) -> Outbox:
        return Outbox(store, bus, clock=clock, plugins=[recorder], load_entry_points=False)

    # -- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def require(store: Store, capability: str) -> None:
        """Skip the test unless ``store`` declares ``capability``."""
        if capability not in store.capabilities:
            pytest.skip(f"store does not declare the {capability!r} capability")

    @staticmethod
    def put(
        store: Store,
        now: datetime | None,
        *events: tuple[str, Any] | tuple[str, Any, float],
    ) -> list[int]:
        """Enqueue ``(topic, payload[, delay])`` events in one committed store transaction."""
        built = [build_event(e[0], e[1], delay=e[2] if len(e) > 2 else None) for e in events]
        with store.transaction() as conn:
            return store.enqueue(conn, built, now=now)

    @staticmethod
    def claim(
        store: Store,
        now: datetime | None,
        batch_size: int = 100,
        lease: timedelta = LEASE,
    ) -> list[Claim]:
        return store.claim(batch_size=batch_size, lease=lease, now=now)

    @staticmethod
    def ids(claims: Sequence[Claim]) -> list[int]:
        return [c.event.id for c in claims]

    @staticmethod
    def drain(outbox: Outbox, clock: FrozenClock, *, rounds: int = 100, step: float = 301) -> None:
        """Poll until nothing is due and nothing is waiting for a retry (bounded)."""
        poller = outbox.poller(batch_size=50)
        for _ in range(rounds):
            if not poller.run_once().claimed:
                stats = outbox.stats()
                if stats.pending == 0 and stats.claimed == 0:
                    return
                clock.advance(step)
        raise AssertionError(f"drain did not finish in {rounds} rounds: {outbox.stats()}")
