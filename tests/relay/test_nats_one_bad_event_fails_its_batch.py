"""NATS: one event NATS cannot take failed its whole batch, every time (fixed).

A subject with a space, or a payload under outboxkit's 1 MiB limit that is over the server's
``max_payload`` once the headers are added: the client refused the first halfway through the
batch, the server closed the connection on the second, and every healthy event of the batch
failed with it (10 of 10 dead-lettered, 5 of them already in the stream). Such a message is now
refused before it is sent (``outboxkit.relay.nats.unsendable``): only it fails, with an error
naming the event and why, and its batch-mates are published on the same connection.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from outboxkit import EventBus, FrozenClock, Message, Outbox, open_store
from outboxkit.relay.nats import MAX_SUBJECT_BYTES, NatsRelay, unsendable
from tests.relay.brokers import nats_jetstream


@pytest.mark.asyncio
async def test_one_event_nats_cannot_take_fails_alone_not_its_batch(tmp_path: Path) -> None:
    async with nats_jetstream() as broker:
        max_payload = broker.extra["js"]._nc.max_payload  # the server's INFO
        relay = broker.relay()
        assert isinstance(relay, NatsRelay)
        bus = EventBus()
        bus.relay(relay, topics=[broker.topic("#")], name="relay")
        store = open_store(f"sqlite:///{(tmp_path / 'outbox.db').as_posix()}")
        outbox = Outbox(
            store,
            bus,
            clock=FrozenClock("2030-01-01T00:00:00Z"),
            max_retries=0,
            max_payload_bytes=max_payload,
        )
        try:
            good = broker.topic("order.placed")
            # Within outboxkit's limit (payload and headers at most max_payload), over the
            # server's once the relay's headers are added.
            big = {"blob": "x" * (max_payload - 100)}
            messages = [Message(good, {"n": n}) for n in range(10)]
            messages[3] = Message(broker.topic("bad subject"), {"n": 3})
            messages[6] = Message(good, big)
            with store.transaction() as tx:
                ids = outbox.enqueue_many(tx, messages)
            bad, oversize = ids[3], ids[6]
            healthy = [i for i in ids if i not in (bad, oversize)]

            report = await outbox.async_poller(batch_size=10, transaction="per_batch").run_once()

            assert report.claimed == ids  # one batch of ten, one publish
            assert sorted(report.published) == healthy  # 8 published
            assert sorted(report.dead_lettered) == [bad, oversize]  # exactly the 2 bad ones
            assert await broker.count() == 8
            assert sorted(await broker.ids()) == healthy
            assert relay._state is not None  # the connection was kept: nothing was lost on it
            bad_event, big_event = store.get(bad), store.get(oversize)
            assert bad_event is not None and big_event is not None
            assert f"NATS cannot take event {bad} (subject {broker.topic('bad subject')!r})" in (
                bad_event.last_error or ""
            )
            assert "whitespace" in (bad_event.last_error or "")
            assert f"NATS cannot take event {oversize} " in (big_event.last_error or "")
            assert f"over the server's max_payload of {max_payload}" in (big_event.last_error or "")
            assert store.records(bad) == store.records(oversize) == []
        finally:
            await relay.aclose()
            await store.async_store().close()
            store.close()


MAX = 1024 * 1024


@pytest.mark.parametrize(
    ("subject", "why"),
    [
        ("", "the subject is empty"),
        ("a b", "whitespace"),
        ("a\tb", "whitespace"),
        ("a\r\nPUB x 1", "whitespace"),
        ("a\x00b", "NUL"),
        ("a..b", "empty token"),
        (".a", "empty token"),
        ("a.", "empty token"),
        ("a.*", "wildcard token"),
        ("a.>", "wildcard token"),
        ("a." + "é" * MAX_SUBJECT_BYTES, f"over the {MAX_SUBJECT_BYTES}"),
    ],
)
def test_a_subject_nats_would_refuse_is_named(subject: str, why: str) -> None:
    problem = unsendable(subject, {}, b"{}", MAX)
    assert problem is not None and why in problem


@pytest.mark.parametrize(
    "subject", ["a", "order.placed", "a.b*c", "a.>b", "ordre.expédié", "x" * MAX_SUBJECT_BYTES]
)
def test_a_subject_nats_takes_passes(subject: str) -> None:
    assert unsendable(subject, {"Nats-Msg-Id": "1"}, b"{}", MAX) is None


def test_the_size_counts_the_headers_as_the_server_does() -> None:
    headers = {"Nats-Msg-Id": "abc", "outbox-topic": " t\r\nu "}  # stripped, CR/LF as spaces
    block = len(b"NATS/1.0\r\nNats-Msg-Id: abc\r\noutbox-topic: t  u\r\n\r\n")
    assert unsendable("t", headers, b"x" * (MAX - block), MAX) is None
    problem = unsendable("t", headers, b"x" * (MAX - block + 1), MAX)
    assert problem == (
        f"the message is {MAX + 1} bytes with its headers ({MAX - block + 1} of payload), "
        f"over the server's max_payload of {MAX}"
    )
    bad_name = unsendable("t", {"bad name": "v"}, b"", MAX)
    assert bad_name is not None and "header name 'bad name'" in bad_name
