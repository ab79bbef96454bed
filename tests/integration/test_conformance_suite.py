"""The conformance suite's own machinery: its composition, ``require``, ``load_factory``,
``drain`` and the ``Recorder`` it exports."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

import outboxkit_conformance as suite
from outboxkit import ConfigurationError, Event, EventBus, FrozenClock, MemoryStore, Outbox
from outboxkit.cli.apps import LoadError
from outboxkit.store import Capabilities
from outboxkit.testing.recorder import Recorder
from outboxkit_conformance import ConformanceBase, StoreConformance, load_factory
from tests.cli.conftest import outboxkit_command

MIXINS = [
    suite.EnqueueTests,
    suite.ClaimTests,
    suite.DeliveryTests,
    suite.SettleTests,
    suite.BatchTests,
    suite.OperationsTests,
    suite.TimeTests,
    suite.TextTests,
    suite.ConcurrencyTests,
    suite.LifecycleTests,
    suite.OrderingTests,
    suite.DedupeTests,
]


def own_tests(cls: type) -> set[str]:
    return {name for name in vars(cls) if name.startswith("test_")}


def test_store_conformance_composes_every_mixin_and_no_test_hides_another() -> None:
    assert set(StoreConformance.__bases__) == set(MIXINS)
    assert all(issubclass(m, ConformanceBase) for m in MIXINS)
    every = [name for m in MIXINS for name in own_tests(m)]
    # A name defined in two mixins would leave only one of the tests in the composition.
    assert len(every) == len(set(every))
    assert set(every) == {name for name in dir(StoreConformance) if name.startswith("test_")}
    assert own_tests(StoreConformance) == set()


def test_the_suite_exports_the_public_recorder() -> None:
    assert suite.Recorder is Recorder
    assert suite.SUITE_VERSION == "1.11.0"


def test_require_takes_the_capabilities_field_names() -> None:
    store = MemoryStore()
    try:
        for field in fields(Capabilities):
            if field.name in store.capabilities:
                ConformanceBase.require(store, field.name)  # declared: no skip
            else:
                with pytest.raises(pytest.skip.Exception, match=repr(field.name)):
                    ConformanceBase.require(store, field.name)
    finally:
        store.close()


@pytest.mark.parametrize("name", ["batch", "concurrent_claimer", "batched_delivery", ""])
def test_require_refuses_an_unknown_name_instead_of_skipping(name: str) -> None:
    # A misspelt (or an earlier version's) name would otherwise skip its test on every store.
    store = MemoryStore()
    try:
        with pytest.raises(ValueError, match=f"unknown capability {name!r}") as info:
            ConformanceBase.require(store, name)
        assert "concurrent_batches" in str(info.value)  # it lists the names it takes
    finally:
        store.close()


def test_load_factory_returns_the_callable() -> None:
    assert load_factory("outboxkit:MemoryStore") is MemoryStore


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no-colon", "store factory must be module:attribute"),
        ("nosuchmodule:make", "cannot import 'nosuchmodule' for store factory"),
        ("outboxkit_conformance:no_such_factory", "has no attribute 'no_such_factory'"),
        ("outboxkit_conformance:SUITE_VERSION", "is not callable"),
    ],
)
def test_load_factory_errors_are_value_errors_naming_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        load_factory(spec)
    assert isinstance(info.value, LoadError)
    assert isinstance(info.value, ConfigurationError)


def make_outbox(clock: FrozenClock) -> tuple[Outbox, EventBus]:
    bus = EventBus()
    return Outbox(MemoryStore(), bus, clock=clock, load_entry_points=False), bus


def test_drain_retries_until_everything_is_settled() -> None:
    clock = FrozenClock("2030-01-01T00:00:00Z")
    outbox, bus = make_outbox(clock)

    @bus.handler("t", name="flaky")
    def flaky(event: Event, ctx: Any) -> None:
        if ctx.attempt < 3:
            raise RuntimeError("not yet")

    with outbox.store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", {})
    report = ConformanceBase.drain(outbox, clock)
    assert report.published == [event_id]
    assert report.retried == [event_id, event_id]
    stats = outbox.stats()
    assert (stats.pending, stats.claimed, stats.published) == (0, 0, 1)
    outbox.store.close()


def test_drain_fails_when_an_event_is_left_pending() -> None:
    clock = FrozenClock("2030-01-01T00:00:00Z")
    outbox, _ = make_outbox(clock)
    with outbox.store.transaction() as conn:
        outbox.enqueue(conn, "t", {}, delay=60)  # scheduled later: a drain does not wait for it
    with pytest.raises(AssertionError, match="drain left events undelivered"):
        ConformanceBase.drain(outbox, clock)
    outbox.store.close()


BROKEN_STORE = '''
import dataclasses

from outboxkit import MemoryStore


class ForgetfulStore(MemoryStore):
    """Its stats never count the last pending event."""

    def stats(self, *args, **kwargs):
        stats = super().stats(*args, **kwargs)
        return dataclasses.replace(stats, pending=max(stats.pending - 1, 0))


def make_store():
    return ForgetfulStore()
'''


def test_the_command_shows_a_failing_checks_values(tmp_path: Path) -> None:
    """``outboxkit conformance`` imports the suite under pytest's assertion rewriting: a failure
    names the values compared, not a bare ``AssertionError``."""
    (tmp_path / "forgetful.py").write_text(BROKEN_STORE, encoding="utf-8")
    result = subprocess.run(
        [
            *outboxkit_command(),
            "conformance",
            "forgetful:make_store",
            "-x",
            "-p",
            "no:cacheprovider",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"^E\s+AssertionError: assert \d+ == \d+$", result.stdout, re.M), result.stdout
    assert re.search(r"^E\s+\+\s+where \d+ = Stats\(pending=", result.stdout, re.M), result.stdout
    assert "PytestAssertRewriteWarning" not in result.stdout + result.stderr
    assert "conformance: 0 passed, 1 failed" in result.stdout


def test_the_command_names_a_factory_it_cannot_load(tmp_path: Path) -> None:
    result = subprocess.run(
        [*outboxkit_command(), "conformance", "nosuch_module:make_store"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2
    assert "cannot import 'nosuch_module' for store factory 'nosuch_module:make_store'" in (
        result.stderr
    )
    assert "conformance:" not in result.stdout  # no run, no summary
