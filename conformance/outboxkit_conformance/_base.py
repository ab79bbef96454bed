"""The base class every conformance mixin derives from: fixtures and small helpers."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import fields
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest

from outboxkit import Claim, EventBus, FrozenClock, Outbox, Store
from outboxkit.core.payload import build_event
from outboxkit.storekit import CAPABILITIES, Capabilities
from outboxkit.testing import Drain, DrainReport, Recorder

from ._modes import MODES, AsyncioBus, AsyncioOutbox, LoopRunner, Mode

__all__ = ["ConformanceBase", "StoreFactory", "call_factory"]

START = "2030-01-01T00:00:00Z"
LEASE = timedelta(seconds=30)
S = timedelta(seconds=1)

CAPABILITY_NAMES = tuple(f.name for f in fields(Capabilities))
"""What ``require`` accepts: the fields of ``Capabilities``, and nothing else."""

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

    @contextmanager
    def another_store(self, tmp_path: Path) -> Iterator[Store]:
        """A second fresh store beside the test's own: ``make_store`` called again, on a
        directory of its own under ``tmp_path``; closed (or its context left) at the end."""
        where = tmp_path / "another-store"
        where.mkdir()
        made = self.make_store(where)
        if isinstance(made, AbstractContextManager):
            with made as store:
                yield store
        else:
            try:
                yield made
            finally:
                made.close()

    @pytest.fixture(params=MODES, ids=[m.name for m in MODES])
    def mode(self, request: pytest.FixtureRequest, store: Store) -> Mode:
        """The delivery mode of the ``outbox`` fixture's pollers (see ``_modes``): the blocking
        poller per event or per batch, or the asyncio poller (skipped for a store without the
        ``asyncio`` capability) per event, per batch, or four events at once."""
        mode: Mode = request.param
        if mode.transaction == "per_batch":
            self.require(store, "batches", "the per_batch modes deliver in batches")
        if mode.asyncio:
            self.require(store, "asyncio", "the asyncio modes run the asyncio poller")
        return mode

    @pytest.fixture
    def bus(self, mode: Mode) -> EventBus:
        return AsyncioBus() if mode.asyncio else EventBus()

    @pytest.fixture
    def recorder(self) -> Recorder:
        return Recorder()

    # Here rather than in the lifecycle mixin, so that a test asking for an outbox runs in every
    # mode whichever mixins a class composes (its ids do not depend on the composition).
    @pytest.fixture
    def outbox(
        self,
        mode: Mode,
        store: Store,
        bus: EventBus,
        clock: FrozenClock,
        recorder: Recorder,
    ) -> Iterator[Outbox]:
        """The outbox, its pollers delivering in the ``mode``."""
        kind = AsyncioOutbox if mode.asyncio else Outbox
        outbox = kind(
            store,
            bus,
            clock=clock,
            plugins=[recorder],
            load_entry_points=False,
            transaction=mode.transaction,
        )
        if not isinstance(outbox, AsyncioOutbox):
            yield outbox
            return
        assert mode.concurrency is not None
        outbox.concurrency = mode.concurrency
        outbox.runner = runner = LoopRunner()
        try:
            yield outbox
        finally:
            try:
                runner.run(store.async_store().close())
            finally:
                runner.close()

    # -- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def require(store: Store, capability: str, why: str | None = None) -> None:
        """Skip the test unless ``store`` declares ``capability``; the skip names the
        capability and why the check needs it.

        Args:
            store: the store under test.
            capability: a field of ``outboxkit.storekit.Capabilities``.
            why: what the check needs the capability for (default: what the capability
                promises, ``outboxkit.storekit.CAPABILITIES``).

        Raises:
            ValueError: ``capability`` is not a field of ``outboxkit.storekit.Capabilities``
                (a misspelt name would otherwise skip the test for every store).
        """
        if capability not in CAPABILITY_NAMES:
            raise ValueError(
                f"unknown capability {capability!r}: require() takes a field of "
                f"outboxkit.storekit.Capabilities ({', '.join(CAPABILITY_NAMES)})"
            )
        if capability not in store.capabilities:
            reason = why if why is not None else CAPABILITIES[capability]
            pytest.skip(
                f"store does not declare the {capability!r} capability; the check needs it: "
                f"{reason}"
            )

    @staticmethod
    def concurrency(outbox: Outbox) -> int:
        """How many events of a batch the outbox's pollers deliver at once."""
        return outbox.concurrency if isinstance(outbox, AsyncioOutbox) else 1

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
    def drain(outbox: Outbox, clock: FrozenClock, *, rounds: int = 100) -> DrainReport:
        """Deliver until every event is published or dead, through ``outboxkit.testing.Drain``
        (the production path; the clock moves to each retry). Handler failures are expected:
        they are retried, not raised.

        Raises:
            AssertionError: an event is still pending or claimed at the end.
            DrainError: more than ``rounds`` rounds claimed something.
        """
        drain = Drain(outbox, clock)
        if isinstance(outbox, AsyncioOutbox):
            report = outbox.runner.run(drain.async_(max_rounds=rounds, raise_errors=False))
        else:
            report = drain(max_rounds=rounds, raise_errors=False)
        stats = outbox.stats()
        if stats.pending or stats.claimed:
            raise AssertionError(f"drain left events undelivered: {stats}\n{report.summary()}")
        return report
