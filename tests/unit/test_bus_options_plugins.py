"""The event bus, option validation (R14), store plugins and observers (pluggy), and the clocks."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from outboxkit import (
    Claimed,
    ConfigurationError,
    Event,
    EventBus,
    ExponentialBackoff,
    FrozenClock,
    HandlerStarted,
    HandlerSucceeded,
    MemoryStore,
    ObserverEvent,
    Outbox,
    Published,
    SystemClock,
    UnknownStore,
    hookimpl,
    open_store,
)
from outboxkit.clock import Clock
from outboxkit.testing import Recorder


def module_handler(event: Event, ctx: Any) -> None:
    """A handler with a stable default name."""


class Handlers:
    def method(self, event: Event, ctx: Any) -> None:
        """A bound method also has a stable default name."""


def _noop(event: Event, ctx: Any) -> None:
    pass


# -- EventBus -----------------------------------------------------------------------------------


def test_handlers_for_unknown_topic_is_empty(bus: EventBus) -> None:
    assert bus.handlers_for("nobody.listens") == ()
    bus.subscribe("other", _noop, name="x")
    assert bus.handlers_for("nobody.listens") == ()


def test_handlers_keep_subscription_order(bus: EventBus) -> None:
    for name in ["zeta", "alpha", "mid"]:
        bus.subscribe("t", _noop, name=name)
    bus.subscribe("u", _noop, name="other-topic")
    assert [s.name for s in bus.handlers_for("t")] == ["zeta", "alpha", "mid"]
    assert [s.name for s in bus.handlers_for("u")] == ["other-topic"]
    assert bus.topics == ("t", "u")


def test_duplicate_handler_name_on_a_topic_is_an_error(bus: EventBus) -> None:
    first = bus.subscribe("order.placed", _noop, name="send-receipt")

    def other(event: Event, ctx: Any) -> None: ...

    with pytest.raises(ConfigurationError, match=r"'order.placed' already has .* 'send-receipt'"):
        bus.subscribe("order.placed", other, name="send-receipt")
    assert bus.handlers_for("order.placed") == (first,)


def test_subscribing_the_same_function_twice_under_its_default_name_is_an_error(
    bus: EventBus,
) -> None:
    bus.subscribe("t", module_handler)
    with pytest.raises(ConfigurationError, match="already has a handler named"):
        bus.subscribe("t", module_handler)


def test_same_name_on_different_topics_is_allowed_but_find_is_ambiguous(bus: EventBus) -> None:
    a = bus.subscribe("a", _noop, name="audit")
    b = bus.subscribe("b", _noop, name="audit")
    assert (bus.handlers_for("a"), bus.handlers_for("b")) == ((a,), (b,))
    with pytest.raises(ConfigurationError, match="2 handlers named 'audit'"):
        bus.find("audit")


def test_find(bus: EventBus) -> None:
    spec = bus.subscribe("t", _noop, name="one")
    bus.subscribe("u", _noop, name="two")
    assert bus.find("one") is spec
    with pytest.raises(ConfigurationError, match=r"no handler named 'three'.*\['one', 'two'\]"):
        bus.find("three")


def test_default_name_is_module_and_qualname(bus: EventBus) -> None:
    spec = bus.subscribe("t", module_handler)
    assert spec.name == f"{__name__}:module_handler"
    assert spec.name == "tests.unit.test_bus_options_plugins:module_handler"
    method = bus.subscribe("t", Handlers().method)
    assert method.name == f"{__name__}:Handlers.method"


def test_lambdas_and_local_functions_need_a_name(bus: EventBus) -> None:
    with pytest.raises(ConfigurationError, match="no stable default name; pass name="):
        bus.subscribe("t", lambda event, ctx: None)

    def local(event: Event, ctx: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="no stable default name"):
        bus.subscribe("t", local)
    assert bus.handlers_for("t") == ()
    named = bus.subscribe("t", lambda event, ctx: None, name="inline")
    assert named.name == "inline"


def test_decorator_returns_the_function_and_registers_it(bus: EventBus) -> None:
    def send(event: Event, ctx: Any) -> None: ...

    decorated = bus.handler("order.placed", name="send", transactional=False)(send)
    assert decorated is send
    (spec,) = bus.handlers_for("order.placed")
    assert (spec.topic, spec.name, spec.fn, spec.transactional) == (
        "order.placed",
        "send",
        send,
        False,
    )
    assert bus.subscribe("order.placed", _noop, name="tx").transactional is True


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"topic": ""}, "topic must be a non-empty string"),
        ({"topic": 5}, "topic must be a non-empty string"),
        ({"topic": "a\x00b"}, "topic must be a non-empty string"),
        ({"handler": "not callable"}, "is not callable"),
        ({"name": ""}, "handler name must be a non-empty string"),
        ({"name": "   "}, "handler name must be a non-empty string"),
        ({"name": "n" * 201}, "at most 200 characters"),
        ({"name": "a\x00"}, "handler name must be"),
        ({"name": 7}, "handler name must be"),
        ({"transactional": "yes"}, "transactional must be True or False"),
        ({"transactional": 1}, "transactional must be True or False"),
    ],
)
def test_subscribe_rejects_bad_arguments(bus: EventBus, kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"topic": "t", "handler": _noop, "name": "h", "transactional": True}
    args.update(kwargs)
    with pytest.raises(ConfigurationError, match=match):
        bus.subscribe(
            args["topic"], args["handler"], name=args["name"], transactional=args["transactional"]
        )
    assert bus.topics == ()


def test_name_at_the_length_limit_is_fine(bus: EventBus) -> None:
    assert bus.subscribe("t", _noop, name="n" * 200).name == "n" * 200


# -- options (R14) ------------------------------------------------------------------------------

BAD_OPTIONS = [
    ("batch_size", 0),
    ("batch_size", -1),
    ("batch_size", 1.5),
    ("batch_size", True),
    ("batch_size", "10"),
    ("batch_size", None),
    ("lease", 0),
    ("lease", -1),
    ("lease", timedelta(0)),
    ("lease", float("nan")),
    ("lease", float("inf")),
    ("lease", 1e300),
    ("lease", "30"),
    ("lease", None),
    ("interval", 0),
    ("interval", -0.5),
    ("interval", timedelta(seconds=-1)),
    ("interval", float("nan")),
    ("interval", "fast"),
    ("max_retries", -1),
    ("max_retries", 1.0),
    ("max_retries", True),
    ("max_retries", "3"),
    ("backoff", "fast"),
    ("backoff", -1),
    ("backoff", timedelta(seconds=-1)),
    ("backoff", float("nan")),
    ("backoff", 1e300),
    # Too large for a float, a timedelta, a database integer or datetime arithmetic:
    # a named error, never an OverflowError.
    ("lease", 10**400),
    ("lease", timedelta.max),
    ("lease", timedelta(days=3661)),
    ("interval", 10**400),
    ("interval", timedelta.max),
    ("backoff", 10**400),
    ("backoff", timedelta.max),
    ("batch_size", 2**63),
    ("batch_size", 100_001),
    ("max_retries", 10**30),
]


@pytest.mark.parametrize(("option", "value"), BAD_OPTIONS)
def test_outbox_rejects_bad_option_naming_it(store: MemoryStore, option: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=option) as info:
        Outbox(store, **{option: value})
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("option", "value"), BAD_OPTIONS)
def test_poller_rejects_bad_option_naming_it(outbox: Outbox, option: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=option) as info:
        outbox.poller(**{option: value})
    assert isinstance(info.value, ValueError)


def test_unknown_poller_option_is_named(outbox: Outbox) -> None:
    with pytest.raises(ConfigurationError, match=r"unknown poller option\(s\) \['batchsize'\]"):
        outbox.poller(batchsize=5)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "1024"])
def test_max_payload_bytes_is_validated(store: MemoryStore, value: object) -> None:
    with pytest.raises(ConfigurationError, match="max_payload_bytes"):
        Outbox(store, max_payload_bytes=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value"),
    [("base", 0), ("base", -1), ("max", 0), ("max", -5.0)],
)
def test_backoff_base_and_max_must_be_positive(option: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"backoff {option} must be > 0"):
        ExponentialBackoff(**{option: value})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"store": "memory://"}, "Store protocol"),
        ({"bus": {"t": []}}, "bus must be an EventBus"),
        ({"clock": "now"}, "clock must have a now"),
    ],
)
def test_outbox_rejects_wrong_collaborators(
    store: MemoryStore, kwargs: dict[str, Any], match: str
) -> None:
    args: dict[str, Any] = {"store": store, "bus": None, "clock": None}
    args.update(kwargs)
    with pytest.raises(ConfigurationError, match=match):
        Outbox(args["store"], args["bus"], clock=args["clock"])


def test_defaults(store: MemoryStore) -> None:
    options = Outbox(store).poller().options
    assert options.interval == timedelta(seconds=0.5)
    assert options.batch_size == 100
    assert options.lease == timedelta(seconds=30)
    assert options.max_retries == 10
    assert options.backoff == ExponentialBackoff()


def test_poller_options_override_the_outbox_defaults(store: MemoryStore) -> None:
    outbox = Outbox(store, max_retries=3, batch_size=7, lease=10, interval=2.0)
    poller = outbox.poller(max_retries=1, lease=timedelta(minutes=1))
    assert poller.options.max_retries == 1
    assert poller.options.lease == timedelta(minutes=1)
    assert poller.options.batch_size == 7  # inherited
    assert poller.options.interval == timedelta(seconds=2)
    # The outbox keeps its own defaults, and None means "keep them".
    assert outbox.options.max_retries == 3
    assert outbox.poller(max_retries=None, backoff=None).options.max_retries == 3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, timedelta(seconds=5)),
        (0.25, timedelta(seconds=0.25)),
        (0, timedelta(0)),
        (timedelta(minutes=2), timedelta(minutes=2)),
    ],
)
def test_constant_backoff(store: MemoryStore, value: object, expected: timedelta) -> None:
    policy = Outbox(store, backoff=value).options.backoff  # type: ignore[arg-type]
    assert [policy(n) for n in (1, 2, 10)] == [expected] * 3


def test_callable_backoff_is_used_as_is(outbox: Outbox) -> None:
    def mine(retry: int) -> float:
        return 42.0

    assert outbox.poller(backoff=mine).options.backoff is mine


# -- open_store and store plugins ---------------------------------------------------------------


class StorePlugin:
    """A store plugin registering ``schemes`` with its own factory."""

    def __init__(self, *schemes: str, factory: Any = None) -> None:
        self.schemes = schemes
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.factory = factory if factory is not None else self.open

    def open(self, url: str, **options: Any) -> MemoryStore:
        self.calls.append((url, options))
        return MemoryStore()

    @hookimpl
    def outboxkit_register_stores(self, register: Any) -> None:
        register("fake", self.factory, schemes=self.schemes)


def test_open_memory_store() -> None:
    a = open_store("memory://")
    b = open_store("memory:///")
    assert isinstance(a, MemoryStore)
    assert isinstance(b, MemoryStore)
    assert a is not b  # every call gives a new, empty store
    assert a.stats(now=None).total == 0


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("memory://somewhere", {}, "just 'memory://'"),
        ("memory://", {"table": "x"}, "takes no options"),
    ],
)
def test_memory_store_refuses_what_it_cannot_honour(
    url: str, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        open_store(url, **options)


def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(UnknownStore, match=r"'redis://'.*known: .*memory://") as info:
        open_store("redis://localhost/0")
    assert isinstance(info.value, ConfigurationError)
    assert isinstance(info.value, ValueError)


def test_unknown_scheme_lists_plugin_schemes_too() -> None:
    with pytest.raises(UnknownStore, match=r"known: .*fake://"):
        open_store("nope://", plugins=[StorePlugin("fake")])


@pytest.mark.parametrize("url", ["memory", "", "/var/app.db", "sqlite:/app.db", 42, None])
def test_malformed_url_is_a_configuration_error(url: object) -> None:
    with pytest.raises(ConfigurationError, match="scheme://") as info:
        open_store(url)  # type: ignore[arg-type]
    assert not isinstance(info.value, UnknownStore)


def test_third_party_store_gets_the_url_and_options() -> None:
    plugin = StorePlugin("fake", "fake+tls")
    store = open_store("fake+tls://host/db", plugins=[plugin], table="outbox")
    assert isinstance(store, MemoryStore)
    assert plugin.calls == [("fake+tls://host/db", {"table": "outbox"})]


def test_doubly_registered_scheme_is_a_configuration_error() -> None:
    one, two = StorePlugin("dup"), StorePlugin("dup")
    assert one.factory != two.factory
    with pytest.raises(ConfigurationError, match="'dup' is registered twice"):
        open_store("dup://x", plugins=[one, two])
    assert one.calls == two.calls == []


def test_a_plugin_cannot_take_over_a_built_in_scheme() -> None:
    with pytest.raises(ConfigurationError, match="'memory' is registered twice"):
        open_store("memory://", plugins=[StorePlugin("memory")])


def test_the_same_factory_registered_twice_is_not_a_conflict() -> None:
    shared = StorePlugin("same")
    other = StorePlugin("same", factory=shared.factory)
    assert isinstance(open_store("same://", plugins=[shared, other]), MemoryStore)
    assert len(shared.calls) == 1


def test_a_factory_that_is_not_callable_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="not callable"):
        open_store("broken://", plugins=[StorePlugin("broken", factory="nope")])


# -- observers ----------------------------------------------------------------------------------


class Collector:
    """An observer compared by identity (pluggy treats equal plugin objects as one plugin)."""

    def __init__(self) -> None:
        self.events: list[ObserverEvent] = []

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        self.events.append(event)


class Broken:
    """An observer that always fails."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        self.calls += 1
        raise RuntimeError("observer is broken")


@pytest.mark.parametrize("broken_first", [True, False])
def test_a_raising_observer_is_logged_and_stops_nobody(
    store: MemoryStore,
    bus: EventBus,
    clock: FrozenClock,
    caplog: pytest.LogCaptureFixture,
    broken_first: bool,
) -> None:
    broken, good = Broken(), Recorder()
    delivered: list[int] = []
    bus.subscribe("t", lambda event, ctx: delivered.append(event.id), name="h")
    plugins = [broken, good] if broken_first else [good, broken]
    outbox = Outbox(store, bus, clock=clock, plugins=plugins)
    with store.transaction() as tx:
        event_id = outbox.enqueue(tx, "t", {})

    with caplog.at_level(logging.ERROR, logger="outboxkit"):
        report = outbox.poller().run_once()

    assert delivered == [event_id]
    assert report.published == [event_id]
    assert store.records(event_id)[0].handler == "h"
    assert [type(e) for e in good.events] == [Claimed, HandlerStarted, HandlerSucceeded, Published]
    assert broken.calls == 4
    failures = [r for r in caplog.records if r.name == "outboxkit" and "observer" in r.message]
    assert len(failures) == 4
    assert all(r.levelno == logging.ERROR for r in failures)
    assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in failures)
    assert "Claimed" in failures[0].message


def test_each_outbox_has_its_own_plugin_manager(
    store: MemoryStore, bus: EventBus, clock: FrozenClock
) -> None:
    first_rec, second_rec = Collector(), Collector()
    first = Outbox(store, bus, clock=clock, plugins=[first_rec])
    second = Outbox(store, bus, clock=clock)
    second.add_observer(second_rec)
    assert first.plugins is not second.plugins

    first.emit(Published(1, "t", 1))
    second.emit(Published(2, "t", 1))

    assert first_rec.events == [Published(1, "t", 1)]
    assert second_rec.events == [Published(2, "t", 1)]


def test_add_observer_is_idempotent(outbox: Outbox, recorder: Recorder) -> None:
    outbox.add_observer(recorder)  # already registered by the fixture
    outbox.emit(Published(1, "t", 1))
    assert recorder.events == [Published(1, "t", 1)]


def test_a_rebound_copy_does_not_share_observers_with_the_original(
    outbox: Outbox, recorder: Recorder
) -> None:
    copy = outbox.rebind(clock=FrozenClock())
    late = Collector()
    copy.add_observer(late)
    assert copy.plugins is not outbox.plugins

    outbox.emit(Published(1, "t", 1))
    outbox.rebind().emit(Published(2, "t", 1))  # a later copy of the original
    copy.emit(Published(3, "t", 1))

    assert late.events == [Published(3, "t", 1)]
    # The original's observers carry over to both copies.
    assert recorder.events == [Published(1, "t", 1), Published(2, "t", 1), Published(3, "t", 1)]


# -- clocks -------------------------------------------------------------------------------------

START = datetime(2030, 1, 1, tzinfo=UTC)


def test_frozen_clock_default_start_is_aware_utc() -> None:
    clock = FrozenClock()
    assert clock.now() == START
    assert clock.now().tzinfo is UTC
    assert clock.now() == clock.now()  # it stands still


@pytest.mark.parametrize(
    "start",
    [
        "2030-01-01T00:00:00Z",
        "2030-01-01T00:00:00z",
        "2030-01-01T02:00:00+02:00",
        datetime(2029, 12, 31, 19, 0, tzinfo=timezone(timedelta(hours=-5))),
    ],
)
def test_frozen_clock_start_is_normalised_to_utc(start: datetime | str) -> None:
    now = FrozenClock(start).now()
    assert now == START
    assert now.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    ("start", "match"),
    [
        (datetime(2030, 1, 1), "time zone"),
        ("2030-01-01T00:00:00", "time zone"),
        ("yesterday", "not an ISO-8601 instant"),
        (1893456000, "datetime or ISO-8601 string"),
    ],
)
def test_frozen_clock_refuses_naive_or_bad_starts(start: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FrozenClock(start)


def test_frozen_clock_advance() -> None:
    clock = FrozenClock(START)
    assert clock.advance(5) == START + timedelta(seconds=5)
    assert clock.advance(timedelta(minutes=1)) == START + timedelta(seconds=65)
    assert clock.advance(0.5) == START + timedelta(seconds=65.5)
    assert clock.advance(0) == START + timedelta(seconds=65.5)
    assert clock.now() == START + timedelta(seconds=65.5)


@pytest.mark.parametrize(
    ("by", "match"),
    [
        (-1, "advance must be >= 0"),
        (timedelta(seconds=-1), "advance must be >= 0"),
        (float("nan"), "advance must be a finite"),
        (float("inf"), "advance must be a finite"),
        (1e300, "advance is too large"),
        ("5", "advance must be seconds or a timedelta"),
        (True, "advance must be seconds or a timedelta"),
    ],
)
def test_frozen_clock_advance_refuses_bad_durations(by: Any, match: str) -> None:
    clock = FrozenClock(START)
    with pytest.raises(ValueError, match=match):
        clock.advance(by)
    assert clock.now() == START


def test_frozen_clock_set_moves_either_way() -> None:
    clock = FrozenClock(START)
    later = START + timedelta(days=3)
    assert clock.set(later) == later
    assert clock.now() == later
    assert clock.set("2029-06-01T12:00:00Z") == datetime(2029, 6, 1, 12, tzinfo=UTC)
    assert clock.now() == datetime(2029, 6, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize("naive", [datetime(2031, 1, 1), "2031-01-01T00:00:00"])
def test_frozen_clock_set_refuses_naive_instants(naive: datetime | str) -> None:
    clock = FrozenClock(START)
    with pytest.raises(ValueError, match="time zone"):
        clock.set(naive)
    assert clock.now() == START


def test_frozen_clock_on_change() -> None:
    clock = FrozenClock(START)
    seen: list[datetime] = []
    also: list[datetime] = []
    unsubscribe = clock.on_change(seen.append)
    clock.on_change(also.append)

    clock.advance(10)
    clock.set(START)
    with pytest.raises(ValueError):
        clock.set(datetime(2031, 1, 1))  # a refused move notifies nobody
    with pytest.raises(ValueError):
        clock.advance(-1)
    unsubscribe()
    clock.advance(1)

    assert seen == [START + timedelta(seconds=10), START]
    assert also == [START + timedelta(seconds=10), START, START + timedelta(seconds=1)]


def test_clocks_satisfy_the_protocol() -> None:
    assert isinstance(FrozenClock(), Clock)
    assert isinstance(SystemClock(), Clock)
    now = SystemClock().now()
    assert now.utcoffset() == timedelta(0)
    assert now > START - timedelta(days=365 * 20)
