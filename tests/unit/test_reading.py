"""``outboxkit.reading``: dead letters streamed in bounded pages (rows sharing one failure
instant included), the keys with a dead event, and ``Outbox.stats().held_keys`` under each
policy."""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit import EventBus, FrozenClock, MemoryStore, Outbox
from outboxkit.core.model import DeadLetter
from outboxkit.errors import ConfigurationError
from outboxkit.reading import dead_keys, iter_dead_letters


def _failing_outbox(**options: Any) -> Outbox:
    bus = EventBus()

    @bus.handler("t", name="h")
    def fail(event: Any, ctx: Any) -> None:
        raise RuntimeError("down")

    return Outbox(
        MemoryStore(), bus, clock=FrozenClock(), max_retries=0, load_entry_points=False, **options
    )


def _kill(outbox: Outbox, batches: int, per_batch: int, key: str | None = None) -> list[int]:
    """``batches`` batches of ``per_batch`` events dead-lettered, each batch at an instant of
    its own (a batch's events share one failure instant)."""
    assert isinstance(outbox.clock, FrozenClock)
    ids: list[int] = []
    for _ in range(batches):
        with outbox.store.transaction() as conn:
            for _ in range(per_batch):
                outbox.enqueue(conn, "t", {}, key=key)
        ids += outbox.poller(batch_size=per_batch).run_once().dead_lettered
        outbox.clock.advance(1)
    return ids


class _Spy:
    """Wraps ``outbox.dead_letters`` to record how many rows each read returned."""

    def __init__(self, outbox: Outbox, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        real = outbox.dead_letters

        def read(**kwargs: Any) -> list[DeadLetter]:
            page = real(**kwargs)
            self.sizes.append(len(page))
            return page

        monkeypatch.setattr(outbox, "dead_letters", read)


def test_streams_every_dead_letter_once_in_order_reading_bounded_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outbox = _failing_outbox()
    ids = _kill(outbox, batches=12, per_batch=50)
    spy = _Spy(outbox, monkeypatch)
    streamed = [d.event.id for d in iter_dead_letters(outbox, page_size=20)]
    assert streamed == ids  # oldest failure first, each once
    # A read holds one page, plus the rows already given that share the cursor's instant
    # (a batch of 50 here): never the 600.
    assert max(spy.sizes) <= 20 + 50
    assert len(spy.sizes) >= 600 // 70


def test_a_failure_instant_shared_by_more_rows_than_a_page_is_read_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outbox = _failing_outbox()
    ids = _kill(outbox, batches=1, per_batch=130)
    streamed = [d.event.id for d in iter_dead_letters(outbox, page_size=7)]
    assert streamed == ids


def test_limit_topic_and_since() -> None:
    outbox = _failing_outbox()
    ids = _kill(outbox, batches=3, per_batch=4)
    assert [d.event.id for d in iter_dead_letters(outbox, limit=5, page_size=2)] == ids[:5]
    assert [d.event.id for d in iter_dead_letters(outbox, topic="other")] == []
    assert isinstance(outbox.clock, FrozenClock)
    since = [d.event.id for d in iter_dead_letters(outbox, since=outbox.clock.now().replace())]
    assert since == []  # nothing failed at or after "now" (the clock moved on)
    with pytest.raises(ConfigurationError, match="page_size"):
        list(iter_dead_letters(outbox, page_size=0))
    with pytest.raises(ConfigurationError, match="limit"):
        list(iter_dead_letters(outbox, limit=0))


def test_dead_keys_name_each_key_with_its_oldest_dead_event() -> None:
    outbox = _failing_outbox(dead_key="release")
    first = _kill(outbox, batches=1, per_batch=1, key="a")
    _kill(outbox, batches=1, per_batch=1, key="a")
    second = _kill(outbox, batches=1, per_batch=1, key="b")
    _kill(outbox, batches=1, per_batch=3)  # no key
    found = dead_keys(outbox)
    assert [(k.key, k.dead.event.id) for k in found] == [("a", first[0]), ("b", second[0])]
    assert [k.key for k in dead_keys(outbox, limit=1)] == ["a"]


@pytest.mark.parametrize(("policy", "held"), [("hold", 1), ("release", 0)])
def test_held_keys_counts_keys_held_under_the_outboxs_policy(policy: str, held: int) -> None:
    outbox = _failing_outbox(dead_key=policy)
    _kill(outbox, batches=1, per_batch=1, key="k")
    stats = outbox.stats()
    assert (stats.dead_keys, stats.held_keys) == (1, held)
    # The store knows no policy: it counts the keys a hold would hold.
    assert outbox.store.stats(now=None).held_keys == 1
