"""``outboxkit.storekit``: a store written from its twelve required methods alone passes the
conformance suite (the checks of what it does not declare skipped, by capability), ``Outbox``
refuses what it cannot keep, and the defaults answer as the memory store does."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields, replace
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import outboxkit.store
from outboxkit import EventBus, FrozenClock, MemoryStore, Message, Outbox, storekit
from outboxkit.core.payload import build_event
from outboxkit.storekit import (
    CAPABILITIES,
    AsyncStoreBase,
    Capabilities,
    Claim,
    ConfigurationError,
    DeadLetterSettlement,
    Event,
    Outcome,
    PublishSettlement,
    RetrySettlement,
    SettleItem,
    Store,
    StoreBase,
)
from outboxkit_conformance import StoreConformance

# -- the example store (examples/dictstore), loaded from its file -----------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dictstore" / "dictstore.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dictstore", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["dictstore"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_example = _load_example()
DictStore = _example.DictStore
DictTransaction = _example.DictTransaction


# -- the tests ----------------------------------------------------------------------------------


class TestDictStoreConformance(StoreConformance):
    """The whole suite on the example store: what it does not declare is skipped."""

    def make_store(self, tmp_path: Path) -> DictStore:
        return DictStore()


REQUIRED = {
    "enqueue",
    "transaction",
    "claim",
    "delivery",
    "extend",
    "settle_many",
    "release",
    "requeue",
    "events",
    "records",
    "purge_published",
    "purge_dead",
}


def test_store_base_requires_exactly_twelve_methods_and_the_example_writes_only_those() -> None:
    assert StoreBase.__abstractmethods__ == REQUIRED
    written = {
        name
        for name, value in vars(DictStore).items()
        if callable(value) and not name.startswith("_")
    }
    assert written == REQUIRED
    assert isinstance(DictStore(), Store)
    with pytest.raises(TypeError, match="abstract method"):
        StoreBase()  # type: ignore[abstract]


def test_the_suite_skips_what_the_example_does_not_declare_naming_the_capability(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        from outboxkit_conformance import StoreConformance
        from tests.unit.test_storekit import DictStore

        class TestDict(StoreConformance):
            def make_store(self, tmp_path):
                return DictStore()
        """
    )
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    checks = "r15 or r16 or two_threads or two_processes or batch_commits or prefetch_claims"
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider", "-k", checks)
    outcomes = result.parseoutcomes()
    assert "passed" not in outcomes and "failed" not in outcomes
    for capability in (
        "ordering",
        "dedupe",
        "batches",
        "concurrent_claimers",
        "multiprocess",
        "asyncio",
    ):
        result.stdout.fnmatch_lines([f"*store does not declare the '{capability}' capability*"])


# -- Outbox refuses what the store cannot keep ---------------------------------------------------


def test_outbox_refuses_a_key_or_a_dedupe_key_before_anything_is_written() -> None:
    store = DictStore()
    outbox = Outbox(store, load_entry_points=False)
    with store.transaction() as conn:
        with pytest.raises(ConfigurationError, match=r"DictStore\(0 events\) keeps no per-key"):
            outbox.enqueue(conn, "t", 1, key="order-7")
        with pytest.raises(ConfigurationError, match=r"DictStore.*dedupe_key='once'"):
            outbox.enqueue(conn, "t", 1, dedupe_key="once")
        with pytest.raises(ConfigurationError, match=r"DictStore.*key='k'"):
            outbox.enqueue_many(conn, [("t", 1), Message("t", 2, key="k")])
        with pytest.raises(ConfigurationError, match=r"DictStore.*dedupe_key='d'"):
            outbox.enqueue_many(conn, [Message("t", 3, dedupe_key="d")])
        assert conn.events == []  # nothing written, the transaction still usable
        kept = outbox.enqueue(conn, "t", "kept")
    assert [e.id for e in store.events()] == [kept]


def test_outbox_refuses_a_key_on_the_async_path_too() -> None:
    store = DictStore()
    outbox = Outbox(store, load_entry_points=False)
    with store.transaction() as conn:
        with pytest.raises(ConfigurationError, match=r"DictStore.*key='k'"):
            asyncio.run(outbox.enqueue_async(conn, "t", 1, key="k"))
        with pytest.raises(ConfigurationError, match=r"DictStore.*dedupe_key='d'"):
            asyncio.run(outbox.enqueue_many_async(conn, [Message("t", 1, dedupe_key="d")]))
        assert conn.events == []


def test_a_handlers_keyed_follow_up_is_refused_on_a_store_without_order() -> None:
    """The refusal covers ``ctx.enqueue`` too: the follow-up's key would be lost; the handler
    fails (naming the store), its delivery is retried, and nothing of it is written."""
    store = DictStore()
    bus = EventBus()

    @bus.handler("t", name="chains")
    def chains(event: Event, ctx: Any) -> None:
        ctx.enqueue("next", {}, key="k")

    outbox = Outbox(store, bus, clock=FrozenClock(), load_entry_points=False)
    with store.transaction() as conn:
        event_id = outbox.enqueue(conn, "t", 1)
    report = outbox.poller().run_once()
    (delivery,) = report.deliveries
    assert delivery.outcome is Outcome.FAILED
    assert "keeps no per-key order" in (delivery.error or "")
    assert report.retried == [event_id]
    assert [e.topic for e in store.events()] == ["t"]


def test_outbox_refuses_to_hold_keys_on_a_store_without_order() -> None:
    with pytest.raises(ConfigurationError, match=r"DictStore\(0 events\).*dead_key=\"hold\""):
        Outbox(DictStore(), dead_key="hold", load_entry_points=False)
    holding = Outbox(MemoryStore(), dead_key="hold", load_entry_points=False)
    with pytest.raises(ConfigurationError, match=r"DictStore.*dead_key=\"hold\""):
        holding.rebind(store=DictStore())
    releasing = Outbox(DictStore(), load_entry_points=False)
    assert releasing.dead_key == "release"


def test_a_store_with_order_and_dedupe_keeps_both_through_the_outbox() -> None:
    store = MemoryStore()
    assert {"ordering", "dedupe"} <= store.capabilities.names()
    outbox = Outbox(store, dead_key="hold", load_entry_points=False)
    with store.transaction() as conn:
        first = outbox.enqueue(conn, "t", 1, key="k", dedupe_key="d")
        again = outbox.enqueue(conn, "t", 2, dedupe_key="d")
    assert again == first
    assert [e.key for e in store.events()] == ["k"]


# -- the defaults answer as the memory store does -----------------------------------------------

START = FrozenClock("2030-01-01T00:00:00Z").now()
S = timedelta(seconds=1)


def _scenario(store: StoreBase | MemoryStore) -> list[Claim]:
    """The same history on any store: published, retried, dead (two topics, one keyed, one
    failing later), claimed, delayed and pending events, with records; the claims left live."""
    with store.transaction() as conn:
        store.enqueue(
            conn,
            [
                build_event("a", 1),
                build_event("a", 2, key="k1"),
                build_event("b", 3),
                build_event("b", 4),
                build_event("a", 5),
                build_event("c", 6, delay=60),
                build_event("b", 7),
            ],
            now=START,
        )
    one, two, three, four = store.claim(batch_size=4, lease=30 * S, now=START)
    with store.delivery(two, now=START) as tx:
        tx.record("h", Outcome.REJECTED, reason="no")
    assert store.settle_many(
        [
            (one, PublishSettlement(), None),
            (two, DeadLetterSettlement(), "h: boom"),
            (three, RetrySettlement(delay=5 * S, retry=1), "h: later"),
        ],
        now=START + S,
    ) == [True, True, True]
    (five, seven) = store.claim(batch_size=2, lease=30 * S, now=START + 2 * S)
    assert store.settle_many([(five, DeadLetterSettlement(), "h: again")], now=START + 3 * S)
    return [four, seven]


@pytest.fixture
def both() -> Iterator[tuple[DictStore, MemoryStore, list[Claim], list[Claim]]]:
    mine, memory = DictStore(), MemoryStore()
    yield mine, memory, _scenario(mine), _scenario(memory)
    memory.close()


def test_get_dead_letters_and_stats_answer_as_the_memory_store(both: Any) -> None:
    mine, memory, _, _ = both
    for event_id in range(0, 10):
        assert mine.get(event_id) == memory.get(event_id)
    assert mine.get(2) is not None and mine.get(99) is None
    for kw in ({}, {"topic": "a"}, {"since": START + 2 * S}, {"limit": 1}, {"topic": "b"}):
        got = mine.dead_letters(**kw)
        assert got == memory.dead_letters(**kw)
    assert [d.event.id for d in mine.dead_letters()] == [2, 5]  # oldest failure first
    assert [r.reason for r in mine.dead_letters()[0].records] == ["no"]
    for at in (START + 3 * S, START + 6 * S, START + 40 * S, START + 61 * S, None):
        assert mine.stats(now=at) == memory.stats(now=at)
    stats = mine.stats(now=START + 3 * S)
    assert (stats.pending, stats.claimed, stats.published, stats.dead) == (2, 2, 1, 2)
    assert stats.held_keys == 1
    assert stats.oldest_due_at is None  # the retry waits for its backoff, the rest is leased


def test_record_many_writes_each_claim_fenced_as_the_memory_store(both: Any) -> None:
    mine, memory, my_claims, memory_claims = both
    for store, (live, other) in ((mine, my_claims), (memory, memory_claims)):
        stale = replace(other, token="stale")
        assert store.record_many("relay", [live, stale], now=START + 4 * S) == [True, False]
    assert mine.records(4) == memory.records(4) != []
    assert mine.records(7) == memory.records(7) == []


def test_rounds_are_the_store_itself_and_a_batch_settles_last_with_settle_many(
    both: Any,
) -> None:
    mine, memory, _, memory_claims = both
    with mine.rounds(concurrency=4) as deliveries:
        assert deliveries is mine
    with memory.rounds() as deliveries:
        assert deliveries is memory
    with pytest.raises(ConfigurationError, match=r"DictStore\(7 events\) has no batches"):
        mine.batch(now=START)
    with pytest.raises(ConfigurationError, match=r"DictStore\(7 events\) has no asyncio side"):
        mine.async_store()
    live, stale = memory_claims[0], replace(memory_claims[1], token="stale")
    with memory.batch(now=START + 4 * S) as batch:  # BatchBase's settle_last
        items: list[SettleItem] = [
            (live, PublishSettlement(), None),
            (stale, PublishSettlement(), None),
        ]
        assert batch.settle_last(items, now=START + 4 * S) == [True, False]
    event = memory.get(live.event.id)
    assert event is not None and event.published_at == START + 4 * S


def test_the_asyncio_bases_default_as_the_blocking_ones() -> None:
    store = MemoryStore()
    with store.transaction() as conn:
        store.enqueue(conn, [build_event("t", 1), build_event("t", 2)], now=START)
    first, second = store.claim(batch_size=2, lease=30 * S, now=START)
    side = store.async_store()

    async def run() -> None:
        async with side.rounds(concurrency=2) as deliveries:
            assert deliveries is side
        assert AsyncStoreBase.make_waiter(side) is None  # the memory store's own wakes
        stale = replace(second, token="stale")
        assert await side.record_many("relay", [first, stale], now=START) == [True, False]
        async with side.batch(now=START) as batch:
            items: list[SettleItem] = [(first, PublishSettlement(), None)]
            assert await batch.settle_last(items, now=START) == [True]
        await side.close()

    asyncio.run(run())
    assert [r.handler for r in store.records(first.event.id)] == ["relay"]
    event = store.get(first.event.id)
    assert event is not None and event.published_at == START
    store.close()


# -- capabilities, the seam's exports, the deprecated names ------------------------------------


def test_ordering_and_dedupe_are_capabilities_a_bare_store_lacks() -> None:
    bare = Capabilities()
    assert not bare.ordering and not bare.dedupe
    assert "ordering" not in bare and "dedupe" not in bare
    assert set(CAPABILITIES) == {f.name for f in fields(Capabilities)}
    assert {"ordering", "dedupe"} <= Capabilities(ordering=True, dedupe=True).names()
    assert outboxkit.store.Capabilities is Capabilities  # the old home still has it


def test_the_seam_exports_what_it_lists() -> None:
    for name in storekit.__all__:
        assert getattr(storekit, name) is not None, name
    # The settlement and the listed dead letter, apart under their two names.
    assert storekit.DeadLetterSettlement().state is storekit.State.DEAD
    assert "failed_at" in {f.name for f in fields(storekit.DeadLetter)}
    assert issubclass(storekit.BatchBase, storekit.DeliveriesBase)
    assert issubclass(storekit.StoreBase, storekit.DeliveriesBase)


DEPRECATED = [
    ("Rounds", "Store.rounds"),
    ("RecordsMany", "Deliveries.record_many"),
    ("AsyncRecordsMany", "AsyncDeliveries.record_many"),
    ("SettlesLast", "BatchTransaction.settle_last"),
    ("AsyncSettlesLast", "AsyncBatchTransaction.settle_last"),
    ("record_each", "deliveries.record_many"),
    ("record_each_async", "await deliveries.record_many"),
    ("settle_last", "batch.settle_last"),
    ("settle_last_async", "await batch.settle_last"),
]


@pytest.mark.parametrize(("name", "instead"), DEPRECATED)
def test_the_old_names_import_with_a_warning_naming_the_replacement(
    name: str, instead: str
) -> None:
    message = rf"outboxkit\.store\.{name} is deprecated: use {re.escape(instead)}"
    with pytest.warns(DeprecationWarning, match=message):
        value = getattr(outboxkit.store, name)
    assert value is not None
    assert name not in outboxkit.store.__all__
    with pytest.raises(AttributeError, match="no_such_name"):
        outboxkit.store.no_such_name  # noqa: B018


def _old(name: str) -> Any:
    """A deprecated name of ``outboxkit.store``, its warning caught."""
    with pytest.warns(DeprecationWarning, match=f"outboxkit.store.{name} is deprecated"):
        return getattr(outboxkit.store, name)


def test_the_old_helpers_still_do_what_they_did() -> None:
    store = MemoryStore()
    with store.transaction() as conn:
        store.enqueue(conn, [build_event("t", 1)], now=START)
    (claim,) = store.claim(batch_size=1, lease=30 * S, now=START)
    assert _old("record_each")(store, "h", [claim], now=START) == [True]
    with store.batch(now=START) as batch:
        assert isinstance(batch, _old("RecordsMany"))
        items = [(claim, PublishSettlement(), None)]
        assert _old("settle_last")(batch, items, now=START) == [True]
    assert store.stats(now=START).published == 1
    assert [r.handler for r in store.records(claim.event.id)] == ["h"]
    store.close()


_POOL_AT_EXIT = """
import sys
from outboxkit.storekit.driver import ConnectionPool

made = []
pool = ConnectionPool(
    lambda: made.append(len(made)) or len(made),
    2,
    reset=lambda conn: True,
    close=lambda conn: print("closed", conn, flush=True),
    what="the pool",
)
first = pool.take()
pool.give(first)  # idle, kept
if sys.argv[1] == "close":
    pool.close()
    print("closed by hand", flush=True)
print("exiting", flush=True)
"""


@pytest.mark.parametrize("how", ["forgotten", "close"])
def test_a_pool_not_closed_closes_its_idle_connections_at_exit_and_once(how: str) -> None:
    """A driver that does not say goodbye when a connection is collected leaves the server
    logging it as aborted: the pool closes what it keeps idle when the interpreter exits,
    unless it was closed already (then nothing is closed twice)."""
    done = subprocess.run(
        [sys.executable, "-c", _POOL_AT_EXIT, how],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = done.stdout.splitlines()
    if how == "close":
        assert lines == ["closed 1", "closed by hand", "exiting"]
    else:
        assert lines == ["exiting", "closed 1"]
