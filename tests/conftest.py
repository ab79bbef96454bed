"""Shared fixtures for outboxkit's own tests (the public pytest plugin is separate)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outboxkit import EventBus, FrozenClock, MemoryStore, Outbox
from outboxkit.testing import Recorder


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--faults",
        action="store_true",
        default=False,
        help="run the fault tier (tests marked 'faults', see tests/faults/)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--faults"):
        return
    skip = pytest.mark.skip(reason="fault tier: run with --faults")
    for item in items:
        if item.get_closest_marker("faults") is not None:
            item.add_marker(skip)


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock("2030-01-01T00:00:00Z")


@pytest.fixture
def store() -> Iterator[MemoryStore]:
    s = MemoryStore()
    yield s
    s.close()


@pytest.fixture
def bus() -> EventBus:
    return EventBus()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def outbox(store: MemoryStore, bus: EventBus, clock: FrozenClock, recorder: Recorder) -> Outbox:
    return Outbox(store, bus, clock=clock, plugins=[recorder])
