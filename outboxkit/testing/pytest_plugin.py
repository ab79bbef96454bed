"""The outboxkit pytest plugin (entry point ``pytest11``, active once outboxkit is installed).

Fixtures: ``outbox_clock``, ``outbox_store``, ``outbox``, ``outbox_drain``. Kept small and lazy:
nothing from outboxkit is imported until a fixture or hook needs it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# The conformance suite's checks are plain asserts in its own modules: rewritten like a test's,
# a failure shows its values (registered before anything imports the suite).
pytest.register_assert_rewrite("outboxkit_conformance")

if TYPE_CHECKING:
    from outboxkit import FrozenClock, Outbox, Store
    from outboxkit.testing.drain import Drain
    from outboxkit.testing.through import StrayWatch

STRAYS: pytest.StashKey[StrayWatch] = pytest.StashKey()
"""The test's ``StrayWatch`` (set by ``outbox_store``; an overridden one sets none)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("outboxkit")
    group.addoption(
        "--outbox-store",
        dest="outbox_store_url",
        default=None,
        metavar="URL",
        help="store URL for the outbox_store fixture (default: a SQLite file per test)",
    )
    group.addoption(
        "--outbox-store-factory",
        dest="outbox_store_factory",
        default=None,
        metavar="MODULE:FACTORY",
        help="the store factory the outboxkit conformance suite checks",
    )
    parser.addini("outboxkit_store", "store URL for the outbox_store fixture", default="")
    parser.addini("outboxkit_app", "module:attribute naming the app's Outbox", default="")
    parser.addini(
        "outboxkit_freezegun", "tie freezegun to the outbox clock", type="bool", default=False
    )
    parser.addini(
        "outboxkit_time_machine",
        "tie time-machine to the outbox clock",
        type="bool",
        default=False,
    )
    parser.addini(
        "outboxkit_strict",
        "fail a test that leaves enqueued events neither drained nor asserted",
        type="bool",
        default=False,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "outbox(now=None, freezegun=None, time_machine=None): start time of outbox_clock, and "
        "whether freezegun or time-machine follows it",
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    # The PostgreSQL test schemas kept for later tests of this process: dropped now. Only if
    # the kit was loaded (nothing is imported for a session that never used it).
    stores = sys.modules.get("outboxkit.testing.stores")
    if stores is not None:
        stores.close_test_stores()


def pytest_assertrepr_compare(config: pytest.Config, op: str, left: Any, right: Any) -> Any:
    # Only once the test kit is loaded: a report cannot exist before, and this hook runs for
    # every failing comparison of every test.
    report = sys.modules.get("outboxkit.testing.report")
    if report is None:
        return None
    for side in (left, right):
        if isinstance(side, report.DrainReport):
            return [f"comparing a DrainReport ({op})", *side.summary().splitlines()]
    return None


@pytest.fixture
def outbox_clock(request: pytest.FixtureRequest) -> Iterator[FrozenClock]:
    """A frozen clock that moves only when told: ``now()``, ``advance()``, ``set()``."""
    from outboxkit import FrozenClock

    marker = request.node.get_closest_marker("outbox")
    kwargs = marker.kwargs if marker is not None else {}
    clock = FrozenClock(kwargs["now"]) if kwargs.get("now") else FrozenClock()
    freezegun_tie = _tie(request, kwargs, "freezegun", "outboxkit_freezegun")
    time_machine_tie = _tie(request, kwargs, "time_machine", "outboxkit_time_machine")
    if freezegun_tie and time_machine_tie:
        raise pytest.UsageError(
            "outboxkit: tie either freezegun or time-machine to outbox_clock, not both "
            f"({request.node.nodeid})"
        )
    if freezegun_tie:
        import freezegun

        from outboxkit.testing.clocks import FreezegunClock

        # real_asyncio: asyncio's loop keeps its real monotonic clock, so an async def handler
        # awaiting a timer (asyncio.sleep, wait_for) is not frozen forever.
        with freezegun.freeze_time(clock.now(), real_asyncio=True) as frozen:
            yield FreezegunClock(frozen)
        return
    if time_machine_tie:
        import time_machine

        from outboxkit.testing.clocks import TimeMachineClock

        with time_machine.travel(clock.now(), tick=False) as traveller:
            yield TimeMachineClock(traveller)
        return
    yield clock


def _tie(request: pytest.FixtureRequest, kwargs: dict[str, Any], name: str, ini: str) -> bool:
    tie = kwargs.get(name)
    if tie is None:
        tie = bool(request.config.getini(ini))
    return bool(tie)


@pytest.fixture
def outbox_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A fresh, migrated store per test: a SQLite file under ``tmp_path`` unless
    ``--outbox-store=URL`` or the ``outboxkit_store`` ini option says otherwise."""
    from outboxkit.testing.stores import open_test_store
    from outboxkit.testing.through import StrayWatch

    url = request.config.getoption("outbox_store_url") or request.config.getini("outboxkit_store")

    def tmp_path() -> Path:  # made only when a SQLite file needs a folder of the test's
        folder: Path = request.getfixturevalue("tmp_path")
        return folder

    with open_test_store(url or None, tmp_path, request.node.nodeid) as store:
        watch = StrayWatch(store)
        watch.install()
        request.node.stash[STRAYS] = watch
        yield store


@pytest.fixture
def outbox(
    request: pytest.FixtureRequest, outbox_store: Store, outbox_clock: FrozenClock
) -> Outbox:
    """The app's ``Outbox`` (ini ``outboxkit_app``) rebound to the test store and clock, or a
    fresh one with an empty bus."""
    from outboxkit import EventBus, Outbox

    spec = request.config.getini("outboxkit_app")
    if not spec:
        return Outbox(outbox_store, EventBus(), clock=outbox_clock)
    app = _load_app(str(spec))
    return app.rebind(store=outbox_store, clock=outbox_clock)


@pytest.fixture
def outbox_drain(
    request: pytest.FixtureRequest, outbox: Outbox, outbox_clock: FrozenClock
) -> Iterator[Drain]:
    """Deliver everything due, on the production path: ``outbox_drain()``, or
    ``await outbox_drain.async_()`` in an ``async def`` test. An app with ``async def``
    handlers is drained by the asyncio poller (``outbox_drain()`` runs it on a loop of its
    own), any other by the blocking poller."""
    from outboxkit.testing.drain import Drain

    watch = request.node.stash.get(STRAYS, None)
    # Every event of the store, when it is the test's own (outbox_store's, whoever provides
    # it); else (the app's own store, which may outlive the test) those enqueued from now on.
    own = "outbox_store" in request.fixturenames and (
        request.getfixturevalue("outbox_store") is outbox.store
    )
    since = 0 if own else _last_id(outbox)
    drain = Drain(outbox, outbox_clock, strays=watch, since=since)
    yield drain
    if request.config.getini("outboxkit_strict"):
        left = drain.unaccounted()
        if left:
            listing = "\n".join(f"  event {e.id} {e.topic!r}: {e.payload!r}" for e in left[:20])
            pytest.fail(
                f"outboxkit_strict: {len(left)} enqueued event(s) were neither drained nor "
                f"asserted:\n{listing}",
                pytrace=False,
            )


def _last_id(outbox: Outbox) -> int:
    """The id of the newest event of ``outbox``'s store (0 when it has none)."""
    from outboxkit.testing.drain import PAGE

    last = 0
    while page := outbox.store.events(after_id=last, limit=PAGE):
        last = page[-1].id
        if len(page) < PAGE:
            break
    return last


def _load_app(spec: str) -> Outbox:
    """The ``Outbox`` the ini option ``outboxkit_app`` names.

    Raises:
        pytest.UsageError: the spec is malformed, does not import, or names no ``Outbox``.
    """
    from outboxkit import Outbox
    from outboxkit.cli.apps import LoadError, load_object

    try:
        app: Outbox = load_object(spec, what="outboxkit_app", kind=Outbox)
    except LoadError as exc:
        raise pytest.UsageError(str(exc)) from exc
    return app
