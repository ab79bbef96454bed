"""``Outbox``: the app-facing object tying a store, a bus, a clock and the plugins together."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

import pluggy

from .bus import EventBus
from .clock import (
    Clock,
    FrozenClock,
    MonotonicClock,
    SystemClock,
    as_timedelta,
    require_aware,
)
from .context import ContextMaker
from .contrib import adapter_for
from .core.backoff import BackoffPolicy
from .core.duration import MAX_DURATION, before
from .core.model import (
    DEAD_KEY_CHOICES,
    AttemptError,
    DeadKey,
    DeadLetter,
    Event,
    Migration,
    NewEvent,
    ObserverEvent,
    Stats,
)
from .core.options import PollerOptions, TransactionMode
from .core.payload import DEFAULT_MAX_PAYLOAD_BYTES, build_event
from .errors import ConfigurationError, InvalidEvent, StoreError
from .plugins import make_plugin_manager, notify, register
from .reports import Reporter
from .runtime import Runtime
from .store import AsyncStore, Store
from .storekit.bases import StoreBase

if TYPE_CHECKING:
    from .aio import AsyncPoller
    from .context import SessionProvider
    from .poller import Poller
    from .waiter import AsyncWaiter, Waiter, Wakeable

__all__ = ["DeadKey", "Message", "Outbox"]

log = logging.getLogger("outboxkit")

PURGE_PAGE_SIZE = 1000
PRUNE_EVERY = timedelta(minutes=1)
DEFAULT_RETAIN_PUBLISHED = timedelta(days=7)


@dataclass(frozen=True, slots=True)
class Message:
    """One event for :meth:`Outbox.enqueue_many`."""

    topic: str
    payload: Any
    headers: Mapping[str, str] | None = None
    key: str | None = None
    delay: float | timedelta | None = None
    dedupe_key: str | None = None
    available_at: datetime | None = None


class Outbox:
    """An application's outbox.

    Args:
        store: where events live (``open_store(url)`` or a store object).
        bus: the handler subscriptions; a fresh empty ``EventBus`` if omitted.
        clock: the clock; ``None`` means the store's production clock (the database clock on
            Postgres). Tests pass a ``FrozenClock``.
        max_retries: app-wide poller default (R14, see ``PollerOptions``), as are the next
            six; an option given to :meth:`poller` wins.
        backoff: app-wide poller default: the retry delays.
        interval: app-wide poller default: the wait between idle polls.
        batch_size: app-wide poller default: events per claim.
        lease: app-wide poller default: how long a claim is held.
        transaction: app-wide poller default: ``"per_event"`` or ``"per_batch"``.
        prefetch: app-wide poller default: claim the next batch while one is delivered.
        max_payload_bytes: the largest encoded payload ``enqueue`` accepts (default 1 MiB).
        dead_key: what a dead-lettered event does to the events after it of the same ``key``:
            ``"release"`` (default) lets them go on; ``"hold"`` keeps the key waiting until the
            dead event is requeued or purged (``stats().held_keys`` counts such keys).
        retain_published: how long published events (and their delivery records) are kept;
            pollers running ``run_forever`` prune older ones once a minute (see :meth:`prune`).
            Default 7 days; ``None`` keeps them forever. Dead letters are never pruned.
        plugins: observer plugins (objects with ``outboxkit_on_event``) to register.
        load_entry_points: also load the plugins installed under the ``outboxkit`` entry point.

    Raises:
        ConfigurationError: an option is invalid (the message names it); ``dead_key="hold"``
            on a store without per-key order (``capabilities.ordering``); a plugin's hook is
            an ``async def`` (observers are called synchronously: see :meth:`add_observer`).
    """

    def __init__(
        self,
        store: Store,
        bus: EventBus | None = None,
        *,
        clock: Clock | None = None,
        max_retries: int = 10,
        backoff: BackoffPolicy | float | timedelta | None = None,
        interval: float | timedelta = 0.5,
        batch_size: int = 100,
        lease: float | timedelta = 30.0,
        transaction: TransactionMode = "per_event",
        prefetch: bool = False,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        dead_key: DeadKey = "release",
        retain_published: float | timedelta | None = DEFAULT_RETAIN_PUBLISHED,
        plugins: Iterable[object] = (),
        load_entry_points: bool = True,
    ) -> None:
        if not _is_store(store):
            raise ConfigurationError(
                f"store must implement the outboxkit Store protocol (derive it from "
                f"outboxkit.storekit.StoreBase): {store!r}"
            )
        if bus is not None and not isinstance(bus, EventBus):
            raise ConfigurationError(f"bus must be an EventBus, got {bus!r}")
        if clock is not None and not isinstance(clock, FrozenClock | SystemClock | Clock):
            raise ConfigurationError(f"clock must have a now() method, got {clock!r}")
        if (
            not isinstance(max_payload_bytes, int)
            or isinstance(max_payload_bytes, bool)
            or max_payload_bytes < 1
        ):
            raise ConfigurationError(
                f"max_payload_bytes must be an integer >= 1, got {max_payload_bytes!r}"
            )
        if dead_key not in DEAD_KEY_CHOICES:
            raise ConfigurationError(f"dead_key must be 'release' or 'hold', got {dead_key!r:.40}")
        _check_dead_key(store, dead_key)
        self.dead_key: DeadKey = dead_key
        self.store = store
        self.bus = bus if bus is not None else EventBus()
        self.options = PollerOptions.build(
            max_retries=max_retries,
            backoff=backoff,
            interval=interval,
            batch_size=batch_size,
            lease=lease,
            transaction=transaction,
            prefetch=prefetch,
        )
        self.max_payload_bytes = max_payload_bytes
        self.retain_published: timedelta | None = (
            None
            if retain_published is None
            else _duration(
                "retain_published", retain_published, allow_zero=False, maximum=MAX_DURATION
            )
        )
        self._next_prune_at: datetime | None = None
        self._prune_lock = threading.Lock()
        # Bind the given clock's instants into every store call; without one, pass None so the
        # store uses its production clock (the database's on PostgreSQL). Local deadlines (a
        # poller's leases, the prune schedule) go by the given clock in tests and by a monotonic
        # clock in production: a step of the host's wall clock cannot move them.
        self._bind_clock = clock is not None
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.local_clock: Clock = clock if clock is not None else MonotonicClock()
        self._plugin_list = list(plugins)
        self._load_entry_points = load_entry_points
        self.plugins: pluggy.PluginManager = make_plugin_manager(
            self._plugin_list, load_entry_points=load_entry_points, stores=False
        )
        self._waiters: list[Wakeable] = []
        self._waiters_lock = threading.Lock()
        self.sessions: SessionProvider | None = None
        """What makes a handler's ``ctx.session`` (set by an ORM integration, e.g.
        ``outboxkit.contrib.sqlalchemy.use_sessions``); None: ``ctx.session`` is refused."""

    def __repr__(self) -> str:
        return f"Outbox({self.store!r}, {self.bus!r}, clock={self.clock!r})"

    # -- time -----------------------------------------------------------------------------------

    def store_now(self) -> datetime | None:
        """The instant to bind into store calls: the injected clock's, or None (store's clock).

        Raises:
            ConfigurationError: the injected clock returned a naive datetime.
        """
        return self._checked_now() if self._bind_clock else None

    def now(self) -> datetime:
        """The time by the store's clock: the injected clock's, or without one the store's own
        production clock (the database's on PostgreSQL). Every cutoff (purge, prune, a
        ``--since``) is computed from it, never from the host's wall clock.

        Raises:
            ConfigurationError: the injected clock returned a naive datetime.
            StoreError: the store could not be asked.
        """
        return self._checked_now() if self._bind_clock else self.store.now()

    def _checked_now(self) -> datetime:
        now = self.clock.now()
        if getattr(now, "tzinfo", None) is None or now.utcoffset() is None:
            raise ConfigurationError(
                f"the outbox's clock {self.clock!r} returned {now!r}; clocks must return "
                "timezone-aware datetimes (naive ones are refused)"
            )
        return now

    def rebind(self, *, store: Store | None = None, clock: Clock | None = None) -> Outbox:
        """A copy using another store and/or clock; the same bus, options and plugins.

        The original is untouched (the test kit uses this to point an app's outbox at a test store).

        Raises:
            ConfigurationError: the outbox holds keys dead (``dead_key="hold"``) and ``store``
                keeps no per-key order (``capabilities.ordering``).
        """
        if store is not None:
            _check_dead_key(store, self.dead_key)
        state = dict(vars(self))
        if store is not None:
            state["store"] = store
        if clock is not None:
            state.update(clock=clock, local_clock=clock, _bind_clock=True)
        # Its own list too: an observer added to the copy must not leak into the original;
        # its own waiters and retention schedule.
        plugins = list(self._plugin_list)
        state.update(
            _plugin_list=plugins,
            plugins=make_plugin_manager(
                plugins, load_entry_points=self._load_entry_points, stores=False
            ),
            _waiters=[],
            _waiters_lock=threading.Lock(),
            _next_prune_at=None,
            _prune_lock=threading.Lock(),
        )
        copy = type(self).__new__(type(self))  # a subclass stays one
        vars(copy).update(state)
        return copy

    # -- writing --------------------------------------------------------------------------------

    def enqueue(
        self,
        conn: Any,
        topic: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        delay: float | timedelta | None = None,
        dedupe_key: str | None = None,
        available_at: datetime | None = None,
    ) -> int:
        """Write one event through ``conn``, inside the caller's open transaction (R1).

        Never begins, commits or rolls back. The event exists iff the caller's transaction commits.

        Args:
            conn: the app's connection in its open transaction (sqlite3 / psycopg connection,
                or a ``MemoryTransaction``).
            topic: the topic handlers subscribe to.
            payload: plain JSON (dict, list, str, int, float, bool, None).
            headers: optional str -> str metadata.
            key: optional ordering key: the events of one key are delivered one at a time,
                in the order their transactions committed (R15).
            delay: seconds or timedelta before the event becomes due.
            dedupe_key: optional idempotency key: while an event with it exists (until it is
                purged), another enqueue with it writes nothing and returns that event's id.
            available_at: an aware instant at which the event becomes due (instead of
                ``delay``; a past instant is due at once, in due order).

        Returns:
            The new event's id (the existing one's, for a dedupe key already taken).

        Raises:
            InvalidEvent: the event is invalid (a naive ``available_at``, both ``delay`` and
                ``available_at``...); nothing was written, the transaction is usable.
            ConfigurationError: a ``key`` on a store without per-key order
                (``capabilities.ordering``), or a ``dedupe_key`` on one without dedupe keys
                (``capabilities.dedupe``); nothing was written, the transaction is usable.
            StoreError: the store failed to write.
        """
        event = build_event(
            topic,
            payload,
            headers=self.headers_for(topic, headers),
            key=key,
            delay=delay,
            max_payload_bytes=self.max_payload_bytes,
            dedupe_key=dedupe_key,
            available_at=available_at,
        )
        (event_id,) = self._write(conn, [event])
        return event_id

    def enqueue_many(self, conn: Any, events: Iterable[Message | tuple[str, Any]]) -> list[int]:
        """Write several events in one statement, inside the caller's open transaction.

        Every event is validated before anything is written: one bad event writes none.

        Args:
            conn: as for :meth:`enqueue`.
            events: ``Message`` objects or ``(topic, payload)`` pairs.

        Returns:
            The new ids, in order (for a dedupe key already taken, by an earlier event or
            one before it in ``events``, that event's id).

        Raises:
            InvalidEvent: an event is invalid (the message gives its index); nothing was written.
            ConfigurationError: an event has a ``key`` or a ``dedupe_key`` the store cannot
                keep (as for :meth:`enqueue`); nothing was written.
            StoreError: the store failed to write.
        """
        built = self._build_many(events)
        return self._write(conn, built) if built else []

    async def enqueue_async(
        self,
        conn: Any,
        topic: str,
        payload: Any,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
        delay: float | timedelta | None = None,
        dedupe_key: str | None = None,
        available_at: datetime | None = None,
    ) -> int:
        """:meth:`enqueue` from async code, through the app's async connection inside its open
        transaction (R1): psycopg's ``AsyncConnection`` on PostgreSQL, an aiosqlite connection
        on SQLite, a ``MemoryTransaction`` on the memory store. Never begins, commits or rolls
        back; the event is checked before any SQL.

        Returns:
            The new event's id.

        Raises:
            InvalidEvent: the event is invalid; nothing was written, the transaction is usable.
            ConfigurationError: the store has no asyncio side, or ``conn`` is not a connection
                it takes in an open transaction; a ``key`` or a ``dedupe_key`` the store cannot
                keep (as for :meth:`enqueue`).
            StoreError: the store failed to write.
        """
        event = build_event(
            topic,
            payload,
            headers=self.headers_for(topic, headers),
            key=key,
            delay=delay,
            max_payload_bytes=self.max_payload_bytes,
            dedupe_key=dedupe_key,
            available_at=available_at,
        )
        (event_id,) = await self._write_async(conn, [event])
        return event_id

    async def enqueue_many_async(
        self, conn: Any, events: Iterable[Message | tuple[str, Any]]
    ) -> list[int]:
        """:meth:`enqueue_many` from async code (see :meth:`enqueue_async`).

        Raises:
            InvalidEvent: an event is invalid (the message gives its index); nothing was written.
            ConfigurationError: as for :meth:`enqueue_async`.
            StoreError: the store failed to write.
        """
        built = self._build_many(events)
        return await self._write_async(conn, built) if built else []

    def _write(self, conn: Any, events: Sequence[NewEvent]) -> list[int]:
        """Checked ``events`` through ``conn``: the store takes a driver's connection itself,
        a framework's connection or session goes through its integration (``contrib``)."""
        self._check_keys(events)
        adapter = adapter_for(conn)
        if adapter is None:
            ids = self.store.enqueue(conn, events, now=self.store_now())
            self.wake()  # before the commit: a store's waiter wakes the pollers at it
        else:
            ids = adapter.enqueue(self.store, conn, events, now=self.store_now())
            if self._waiters:
                adapter.on_commit(conn, self.wake)
        return ids

    async def _write_async(self, conn: Any, events: Sequence[NewEvent]) -> list[int]:
        """``_write`` through an async connection or session."""
        self._check_keys(events)
        adapter = adapter_for(conn)
        if adapter is None:
            ids = await self._async_store().enqueue(conn, events, now=self.store_now())
        else:
            ids = await adapter.enqueue_async(self.store, conn, events, now=self.store_now())
        self.wake()
        return ids

    def _check_keys(self, events: Sequence[NewEvent]) -> None:
        """Refuse, before anything is written, a key the store keeps no order for and a dedupe
        key it cannot keep (what it cannot keep would otherwise be silently lost).

        Raises:
            ConfigurationError: naming the store, the key and the capability it lacks.
        """
        capabilities = self.store.capabilities
        for event in events:
            if event.key is not None and not capabilities.ordering:
                raise ConfigurationError(
                    f"{self.store!r} keeps no per-key order (capabilities.ordering is false): "
                    f"cannot enqueue with key={event.key!r:.80}; enqueue without a key"
                )
            if event.dedupe_key is not None and not capabilities.dedupe:
                raise ConfigurationError(
                    f"{self.store!r} has no dedupe keys (capabilities.dedupe is false): "
                    f"cannot enqueue with dedupe_key={event.dedupe_key!r:.80}; enqueue "
                    "without one"
                )

    def _async_store(self) -> AsyncStore:
        if not self.store.capabilities.asyncio:
            raise ConfigurationError(
                f"{self.store!r} has no asyncio side (capabilities.asyncio is false): enqueue "
                "through a blocking connection with enqueue()"
            )
        return self.store.async_store()

    def _build_many(self, events: Iterable[Message | tuple[str, Any]]) -> list[NewEvent]:
        """Every event checked before anything is written: one bad event writes none."""
        built: list[NewEvent] = []
        limit = self.max_payload_bytes
        for index, item in enumerate(events):
            try:
                if isinstance(item, tuple) and len(item) == 2:
                    built.append(
                        build_event(
                            item[0],
                            item[1],
                            headers=self.headers_for(item[0], None),
                            max_payload_bytes=limit,
                        )
                    )
                elif isinstance(item, Message):
                    built.append(
                        build_event(
                            item.topic,
                            item.payload,
                            headers=self.headers_for(item.topic, item.headers),
                            key=item.key,
                            delay=item.delay,
                            max_payload_bytes=limit,
                            dedupe_key=item.dedupe_key,
                            available_at=item.available_at,
                        )
                    )
                else:
                    raise InvalidEvent(
                        f"expected a Message or a (topic, payload) pair, got {item!r:.80}"
                    )
            except InvalidEvent as exc:
                raise InvalidEvent(f"event #{index}: {exc}") from None
        return built

    # -- pollers --------------------------------------------------------------------------------

    def poller(
        self, *, concurrency: int = 1, waiter: Waiter | None = None, **options: Any
    ) -> Poller:
        """A poller with the outbox's defaults overridden by ``options`` (R14).

        Args:
            concurrency: per event, how many deliveries may be committing at once (default
                1): the handlers run one at a time, and on PostgreSQL the records of those
                that need no transaction of their own are committed on up to ``concurrency``
                connections at once, without waiting (see ``Poller``).
            waiter: how the poller waits between polls (default: a thread event woken by
                in-process enqueues). Tests inject one that moves a ``FrozenClock`` instead.
            **options: ``interval``, ``batch_size``, ``lease``, ``max_retries``, ``backoff``,
                ``transaction``, ``prefetch`` (see ``PollerOptions``).

        Raises:
            ConfigurationError: an unknown option or an invalid value, naming the option;
                ``transaction="per_batch"`` on a store without ``batched_delivery``, or with
                ``concurrency`` above 1.
        """
        from .poller import Poller

        return Poller(
            self.runtime(),
            PollerOptions.build(self.options, **options),
            waiter=waiter,
            concurrency=concurrency,
        )

    def async_poller(
        self, *, concurrency: int = 1, waiter: AsyncWaiter | None = None, **options: Any
    ) -> AsyncPoller:
        """An asyncio poller with the outbox's defaults overridden by ``options`` (R14).

        Args:
            concurrency: how many events of a claimed batch are delivered at once, each on its
                own connection (default 1).
            waiter: how the poller waits between polls (default: an ``asyncio.Event`` woken
                by in-process enqueues, or the store's, which also wakes on commits elsewhere).
            **options: as for :meth:`poller`.

        Raises:
            ConfigurationError: an unknown option or an invalid value, naming the option; a
                store without an asyncio side; a blocking transactional handler on the bus.
        """
        from .aio import AsyncPoller

        return AsyncPoller(
            self.runtime(),
            PollerOptions.build(self.options, **options),
            concurrency=concurrency,
            waiter=waiter,
        )

    def runtime(self) -> Runtime:
        """What a poller of this outbox needs from it (``outboxkit.runtime.Runtime``): the
        store, the bus, the clocks, the handlers' contexts, the reporter, the dead-key policy,
        the in-process waiters and the retention."""
        return Runtime(
            store=self.store,
            bus=self.bus,
            clock=self.clock,
            local_clock=self.local_clock,
            store_now=self.store_now,
            dead_key=self.dead_key,
            contexts=ContextMaker(
                self.max_payload_bytes, lambda: self.sessions, self.headers_for, self._check_keys
            ),
            reporter=Reporter(self.emit, self.plugins, self.clock, self.local_clock),
            add_waiter=self.add_waiter,
            remove_waiter=self.remove_waiter,
            prune_if_due=self.prune_if_due,
        )

    def add_waiter(self, waiter: Wakeable) -> None:
        with self._waiters_lock:
            self._waiters.append(waiter)

    def remove_waiter(self, waiter: Wakeable) -> None:
        with self._waiters_lock:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def wake(self) -> None:
        """Nudge this process's pollers to poll now instead of at their next interval."""
        if not self._waiters:  # no poller in this process (the usual app): nothing to nudge
            return
        with self._waiters_lock:
            waiters = list(self._waiters)
        for waiter in waiters:
            waiter.wake()

    # -- observers ------------------------------------------------------------------------------

    def add_observer(self, plugin: object) -> None:
        """Register an object with an ``outboxkit_on_event(event)`` hook implementation.

        Args:
            plugin: the observer; its hook is called synchronously, on the poller's thread.

        Raises:
            ConfigurationError: its ``outboxkit_on_event`` (or another hook) is an
                ``async def``, which nothing would await; it is not registered.
        """
        if not self.plugins.is_registered(plugin):
            register(self.plugins, plugin)
            self._plugin_list.append(plugin)

    def emit(self, event: ObserverEvent) -> None:
        """Send ``event`` to every observer, each on its own (a failing one is logged)."""
        notify(self.plugins, event)

    @property
    def observed(self) -> bool:
        """Whether any observer is registered: an observer event nobody listens to need not
        be built."""
        return bool(self.plugins.hook.outboxkit_on_event.get_hookimpls())

    def headers_for(
        self, topic: str, headers: Mapping[str, str] | None
    ) -> Mapping[str, str] | None:
        """``headers`` with what the ``outboxkit_enqueue_headers`` plugins add (a trace
        context, say); a header the caller gave wins. ``headers`` itself without such plugins.

        Args:
            topic: the event's topic.
            headers: the caller's headers (not checked here: ``enqueue`` checks the result).
        """
        hook = self.plugins.hook.outboxkit_enqueue_headers
        if not hook.get_hookimpls():
            return headers
        given: Mapping[str, str] = headers if isinstance(headers, Mapping) else {}
        added: dict[str, str] = {}
        for extra in hook(topic=topic, headers=given):
            if extra:
                added.update(extra)
        if not added or not isinstance(headers, Mapping | None):
            return headers  # nothing to add, or bad headers that enqueue reports as they are
        return {**added, **given}

    # -- operations -----------------------------------------------------------------------------

    def migrate(self) -> Migration | None:
        """Create or upgrade the store's schema. Idempotent.

        Returns:
            What was done (``str()`` of it: ``created schema v5``, ``upgraded 4 -> 5``,
            ``already at v5``), or None when the store has no versioned schema.

        Raises:
            SchemaError: the schema is newer than this version of outboxkit.
        """
        return self.store.migrate()

    def stats(self) -> Stats:
        """Counts by state and topic, the oldest due instant, the keys with a dead event
        (``dead_keys``) and those of them this outbox holds (``held_keys``: all of them under
        ``dead_key="hold"``, none under ``"release"``)."""
        stats = self.store.stats(now=self.store_now())
        # A store that fills only held_keys (the keys a hold would hold) says the same.
        dead_keys = max(stats.dead_keys, stats.held_keys)
        held = dead_keys if self.dead_key == "hold" else 0
        return replace(stats, dead_keys=dead_keys, held_keys=held)

    def dead_letters(
        self,
        *,
        topic: str | None = None,
        since: datetime | timedelta | None = None,
        limit: int = 100,
    ) -> list[DeadLetter]:
        """Dead-lettered events, oldest failure first, with their delivery records.

        Args:
            topic: only this topic.
            since: failed at or after this aware instant, or within this long before now (by
                the store's clock, see :meth:`now`).
            limit: at most this many (1 to 1,000,000).

        Raises:
            ConfigurationError: a naive ``since``, a bad topic or limit.
        """
        if topic is not None:
            _check_topic(topic)
        if isinstance(since, timedelta):
            since = before(self.now(), _duration("since", since))
        elif since is not None:
            since = require_aware(since, "since")
        _check_limit(limit)
        return self.store.dead_letters(topic=topic, since=since, limit=limit)

    def dead_letter(self, event_id: int) -> DeadLetter | None:
        """One dead letter with its delivery records, or None if ``event_id`` is not dead.

        Raises:
            ConfigurationError: ``event_id`` is not an integer.
        """
        (wanted,) = _ids([event_id])
        event = self.store.get(wanted)
        if event is None or event.failed_at is None or event.published_at is not None:
            return None
        return DeadLetter(
            event=event,
            failed_at=event.failed_at,
            last_error=event.last_error,
            records=tuple(self.store.records(wanted)),
        )

    def attempt_errors(self, event_id: int) -> list[AttemptError]:
        """The error of each failed attempt of one event, oldest first, where the store keeps
        them (``capabilities.error_history``: PostgreSQL, SQLite, Django's, memory); ``[]`` where it keeps
        only the last one (``Event.last_error``). A requeued event keeps its history.

        Raises:
            ConfigurationError: ``event_id`` is not an integer.
            StoreError: the store failed.
        """
        (wanted,) = _ids([event_id])
        if not self.store.capabilities.error_history:
            return []
        return cast("KeepsErrors", self.store).attempt_errors(wanted)

    def requeue_dead(
        self,
        *,
        topic: str | None = None,
        page_size: int = PURGE_PAGE_SIZE,
        dry_run: bool = False,
        as_of: datetime | None = None,
    ) -> int:
        """Requeue the dead letters (of ``topic``) that exist when it starts, in pages of
        ``page_size`` (see :meth:`requeue`), each at most once.

        A snapshot: the dead letters that had failed at or before ``as_of`` — by default the
        store's time when the call starts (:meth:`now`: the database's clock on PostgreSQL,
        never this host's) — walked in their order (failure time, then id) with a cursor that
        only moves on. An event requeued here that pollers dead-letter again while it runs
        fails later than the snapshot, or behind the cursor: it stays dead, and the call ends
        however fast the pollers kill what it requeues.

        Args:
            topic: only this topic's dead letters.
            page_size: dead letters per page (1 to 1,000,000).
            dry_run: change nothing; count the dead letters it would requeue.
            as_of: an aware instant: only the dead letters that failed at or before it
                (default: now, by the store's clock).

        Returns:
            How many dead events were requeued (or would be, with ``dry_run``).

        Raises:
            ConfigurationError: an invalid page size, a naive ``as_of``.
            StoreError: the store failed (what was requeued before stays requeued).
        """
        _check_page_size(page_size)
        snapshot = self.now() if as_of is None else require_aware(as_of, "as_of")
        if dry_run:
            return self._count(
                lambda e: e.failed_at is not None and e.failed_at <= snapshot, topic=topic
            )
        requeued = 0
        after: tuple[datetime, int] | None = None  # the last (failed_at, id) requeued
        behind = 0  # dead letters at the cursor's instant, at or before it: read past them
        while True:
            limit = min(page_size + behind, MAX_LIMIT)
            since = None if after is None else after[0]
            page = self.store.dead_letters(topic=topic, since=since, limit=limit)
            passed = 0 if after is None else sum(1 for d in page if _key(d) <= after)
            ahead = [
                d for d in page if d.failed_at <= snapshot and (after is None or _key(d) > after)
            ][:page_size]
            if not ahead:
                if len(page) < limit or page[-1].failed_at > snapshot or limit == MAX_LIMIT:
                    return requeued  # past the last dead letter of the snapshot
                behind = len(page)  # a full page behind the cursor: read past it
                continue
            requeued += self.store.requeue([d.event.id for d in ahead], now=self.store_now())
            after = _key(ahead[-1])
            # Dead letters behind the cursor are read again only when they died again at the
            # cursor's instant (an injected clock that stands still). Once some were, the
            # next read skips them and the ones just requeued, which may join them.
            behind = passed + len(ahead) if passed else 0

    def requeue(self, ids: Iterable[int]) -> int:
        """Make dead events due now with attempts reset (R12); recorded handlers stay done.

        Returns:
            How many dead events were requeued (ids that are not dead are ignored).
        """
        wanted = _ids(ids)
        return self.store.requeue(wanted, now=self.store_now())

    def purge(
        self,
        *,
        published_older_than: float | timedelta | None = None,
        dead_ids: Iterable[int] | None = None,
        dead_older_than: float | timedelta | None = None,
        page_size: int = PURGE_PAGE_SIZE,
        dry_run: bool = False,
    ) -> int:
        """Delete old published events and/or chosen dead letters, in pages of ``page_size``.

        Args:
            published_older_than: published events older than this (seconds or a timedelta).
            dead_ids: these dead letters (ids that are not dead are left alone).
            dead_older_than: dead letters that failed longer ago than this.
            page_size: events deleted per transaction (1 to 1,000,000).
            dry_run: delete nothing; count what would be deleted, by the same cutoffs (it
                reads the events page by page, as ``Store.events`` lists them).

        Returns:
            How many events were deleted (with their delivery records), or would be.

        Raises:
            ConfigurationError: no criterion given, or an invalid duration or page size.
        """
        if published_older_than is None and dead_ids is None and dead_older_than is None:
            raise ConfigurationError(
                "purge needs published_older_than, dead_ids or dead_older_than"
            )
        _check_page_size(page_size)
        published_age = (
            None
            if published_older_than is None
            else _duration("published_older_than", published_older_than)
        )
        dead_age = (
            None if dead_older_than is None else _duration("dead_older_than", dead_older_than)
        )
        ids = None if dead_ids is None else _ids(dead_ids)
        now = self.now()  # the store's clock: a host clock set ahead must not delete fresh rows
        if dry_run:
            return self._count_purge(now, published_age, ids, dead_age)
        deleted = 0
        if published_age is not None:
            cutoff = before(now, published_age)
            while (n := self.store.purge_published(before=cutoff, limit=page_size)) > 0:
                deleted += n
        if ids is not None or dead_age is not None:
            dead_cutoff = None if dead_age is None else before(now, dead_age)
            while (n := self.store.purge_dead(ids=ids, before=dead_cutoff, limit=page_size)) > 0:
                deleted += n
        return deleted

    def _count_purge(
        self,
        now: datetime,
        published_age: timedelta | None,
        ids: Sequence[int] | None,
        dead_age: timedelta | None,
    ) -> int:
        """What :meth:`purge` with these criteria would delete, by the store's own predicates."""
        published_cutoff = None if published_age is None else before(now, published_age)
        dead_cutoff = None if dead_age is None else before(now, dead_age)
        wanted = None if ids is None else frozenset(ids)
        dead_chosen = wanted is not None or dead_cutoff is not None

        def purged(event: Event) -> bool:
            if published_cutoff is not None and event.published_at is not None:
                return event.published_at < published_cutoff
            if not dead_chosen or event.failed_at is None:
                return False
            return (wanted is None or event.id in wanted) and (
                dead_cutoff is None or event.failed_at < dead_cutoff
            )

        return self._count(purged)

    def _count(self, matches: Callable[[Event], bool], *, topic: str | None = None) -> int:
        """How many events (of ``topic``) match, read in pages: a dry run's count."""
        count, after_id = 0, 0
        while page := self.store.events(after_id=after_id, topic=topic, limit=PURGE_PAGE_SIZE):
            count += sum(1 for event in page if matches(event))
            after_id = page[-1].id
        return count

    def prune(self, *, page_size: int = PURGE_PAGE_SIZE) -> int:
        """Delete published events older than ``retain_published``, with their delivery
        records, in pages of ``page_size`` (short transactions, no long locks). Pending events
        and dead letters are never touched. Does nothing when ``retain_published`` is None.

        Returns:
            How many events were deleted.

        Raises:
            ConfigurationError: an invalid page size.
            StoreError: the store failed.
        """
        if self.retain_published is None:
            return 0
        return self.purge(published_older_than=self.retain_published, page_size=page_size)

    def prune_if_due(self) -> int:
        """:meth:`prune`, at most once per minute (by the outbox clock) per ``Outbox``.

        ``Poller.run_forever`` calls it after every poll. A store failure is logged, not raised
        (the poller's own next poll reports an outage), and the prune is tried again a minute
        later.

        Returns:
            How many events were deleted (0 when it was not due).
        """
        if self.retain_published is None:
            return 0
        now = self.local_clock.now()  # a schedule: local, monotonic in production
        with self._prune_lock:
            if self._next_prune_at is not None and now < self._next_prune_at:
                return 0
            self._next_prune_at = now + PRUNE_EVERY
        try:
            deleted = self.prune()
        except StoreError as exc:
            log.warning("pruning published events failed; trying again in a minute: %s", exc)
            return 0
        if deleted:
            log.info("pruned %d published event(s) older than %s", deleted, self.retain_published)
        return deleted


class KeepsErrors(Protocol):
    """A store declaring ``capabilities.error_history`` (``StoreBase`` has the method)."""

    def attempt_errors(self, event_id: int) -> list[AttemptError]: ...


def _is_store(store: object) -> bool:
    """Whether ``store`` implements ``Store``: a ``StoreBase`` does by construction (checked
    first: a runtime protocol's ``isinstance`` looks up each of its members, a cost an
    ``Outbox`` made per test pays every time), anything else structurally."""
    return isinstance(store, StoreBase | Store)


def _check_dead_key(store: Store, dead_key: DeadKey) -> None:
    """``dead_key="hold"`` needs a store that keeps per-key order.

    Raises:
        ConfigurationError: it does not (naming the store).
    """
    if dead_key == "hold" and not store.capabilities.ordering:
        raise ConfigurationError(
            f"{store!r} keeps no per-key order (capabilities.ordering is false): "
            'dead_key="hold" needs it; use dead_key="release"'
        )


def _key(letter: DeadLetter) -> tuple[datetime, int]:
    """Where a dead letter stands in the stores' order of dead letters: failure time, id."""
    return (letter.failed_at, letter.event.id)


def _duration(
    name: str,
    value: float | timedelta,
    *,
    allow_zero: bool = True,
    maximum: timedelta | None = None,
) -> timedelta:
    return as_timedelta(value, what=name, allow_zero=allow_zero, maximum=maximum)


MAX_EVENT_ID = 2**63 - 1
MAX_LIMIT = 1_000_000


def _check_limit(limit: object) -> None:
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(
            f"limit must be an integer from 1 to {MAX_LIMIT:,}, got {limit!r:.40}"
        )


def _check_topic(topic: object) -> None:
    try:
        build_event(topic, None)
    except InvalidEvent as exc:
        raise ConfigurationError(str(exc)) from None


def _check_page_size(page_size: int) -> None:
    if (
        not isinstance(page_size, int)
        or isinstance(page_size, bool)
        or not 1 <= page_size <= MAX_LIMIT
    ):
        raise ConfigurationError(
            f"page_size must be an integer from 1 to {MAX_LIMIT:,}, got {page_size!r:.40}"
        )


def _ids(ids: Iterable[int]) -> list[int]:
    wanted = list(ids)
    bad = [
        i
        for i in wanted
        if not isinstance(i, int) or isinstance(i, bool) or not 1 <= i <= MAX_EVENT_ID
    ]
    if bad:
        raise ConfigurationError(
            f"event ids must be integers from 1 to 2**63 - 1, got {[f'{b!r:.24}' for b in bad[:5]]}"
        )
    return wanted
