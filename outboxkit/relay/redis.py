"""The Redis Streams relay (``outboxkit[redis]``, redis.asyncio): ``XADD``, one pipeline per
batch.

Each event becomes one entry of stream ``destination(event)`` (the topic by default) with
fields ``outbox-message-id`` (the event's message identity, ``Event.message_id``: the
consumer's dedupe key), ``outbox-event-id`` (its local id), ``outbox-topic``, ``outbox-key``
(when set),
``outbox-created-at`` (when known), ``headers`` (the event's headers as a JSON object: the trace
context travels there) and ``payload`` (the payload, JSON). The batch's ``XADD`` commands go in
one pipeline (no ``MULTI``); an entry's reply, its stream id, is its confirm.

At least once, here: an event is recorded delivered once Redis answered its ``XADD``, that is
once the entry is in the memory of the server that answered. Whether it survives that server's
crash is Redis's persistence (``appendonly yes`` with ``appendfsync always`` for every write,
or replication): the relay cannot add that. A reply lost on the way (the connection broke
after the write) makes the event fail and be added again: the stream then holds it twice, with
the same ``outbox-message-id``, which the consumer drops (``outboxkit.relay.inbox.Inbox``).
Redis Streams have no duplicate window.

Order: a pipeline's commands run in order, so a stream gets a batch's events in claim order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError, RelayError
from . import (
    EVENT_ID_HEADER,
    MESSAGE_ID_HEADER,
    BrokerRelay,
    Destination,
    RelayMessage,
    client_module,
    compact_json,
    parse_message_id,
    topic_destination,
)

if TYPE_CHECKING:
    import redis.asyncio

__all__ = ["RedisRelay", "event_id"]

_OWN = (MESSAGE_ID_HEADER, EVENT_ID_HEADER, "outbox-topic", "outbox-key", "outbox-created-at")


def _redis() -> Any:
    client_module("redis.asyncio", "redis")
    return client_module("redis", "redis")


class RedisRelay(BrokerRelay["redis.asyncio.Redis"]):
    """Appends events to Redis streams (see the module docstring).

    Args:
        url: ``redis://[:password@]host:port/db``.
        destination: the stream of an event; its topic by default.
        confirm_timeout: seconds to wait for a batch's replies.
        maxlen: trim each stream to about this many entries (``XADD MAXLEN ~``); None keeps
            everything.
        client_name: the connection's name in ``CLIENT LIST`` (for operators).

    Raises:
        ConfigurationError: a bad option, naming it.
        MissingDependency: redis-py is not installed.
    """

    def __init__(
        self,
        url: str,
        *,
        destination: Destination = topic_destination,
        confirm_timeout: float = 10.0,
        maxlen: int | None = None,
        client_name: str = "outboxkit-relay",
    ) -> None:
        _redis()
        super().__init__(url, destination=destination, confirm_timeout=confirm_timeout)
        if maxlen is not None and (
            isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1
        ):
            raise ConfigurationError(f"maxlen must be a positive integer or None, got {maxlen!r}")
        self.maxlen = maxlen
        if not isinstance(client_name, str) or not client_name.isprintable() or " " in client_name:
            raise ConfigurationError(
                f"client_name must be printable text without spaces, got {client_name!r:.80}"
            )
        self.client_name = client_name

    async def _connect(self) -> redis.asyncio.Redis:
        module = _redis()
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No retry inside the client: a pipeline sent again after a broken connection would
        # add its entries twice without the relay knowing; the relay retries, per event. No
        # socket_timeout either: redis-py would then arm a timer for each reply it reads;
        # ``_send`` bounds the batch's replies as a whole instead.
        client: redis.asyncio.Redis = module.asyncio.Redis.from_url(
            self.url,
            socket_connect_timeout=self.confirm_timeout,
            retry=Retry(NoBackoff(), 0),
            client_name=self.client_name,
        )
        await client.ping()
        return client

    async def _send(
        self, client: redis.asyncio.Redis, messages: Sequence[RelayMessage]
    ) -> list[Exception | None]:
        pipe = client.pipeline(transaction=False)
        for message in messages:
            pipe.xadd(
                message.destination,
                fields(message),  # type: ignore[arg-type]
                maxlen=self.maxlen,
                approximate=True,
            )
        replies = await asyncio.wait_for(pipe.execute(raise_on_error=False), self.confirm_timeout)
        return [self._answer(m, r) for m, r in zip(messages, replies, strict=True)]

    def _refusal(self, message: RelayMessage, exc: Exception) -> RelayError | None:
        # In a pipeline's replies an error is the server's answer to that one command.
        return RelayError(
            f"Redis refused event {message.event_id} ({message.destination!r}): {str(exc)[:300]}",
            refused=True,
        )

    async def _disconnect(self, client: redis.asyncio.Redis) -> None:
        await client.aclose()


def fields(message: RelayMessage) -> dict[str, str | bytes]:
    """The stream entry of ``message`` (see the module docstring)."""
    entry: dict[str, str | bytes] = {
        name: message.headers[name] for name in _OWN if name in message.headers
    }
    own = {k: v for k, v in message.headers.items() if k not in _OWN}
    entry["headers"] = compact_json(own) if own else "{}"  # no headers of the app's: nearly always
    entry["payload"] = message.body
    return entry


def event_id(entry: Mapping[Any, Any]) -> str:
    """The message identity of a stream entry's fields (as ``XREAD``/``XREADGROUP`` return
    them, bytes or str keys): its ``outbox-message-id``, or for an entry added before the
    stores kept message ids its ``outbox-event-id``; the dedupe key (``Inbox.accept``).

    Returns:
        A UUID's text, or the decimal event id of an entry added before the upgrade.

    Raises:
        ValueError: the entry was not added by a relay.
    """
    return parse_message_id(*(_field(entry, name) for name in (MESSAGE_ID_HEADER, EVENT_ID_HEADER)))


def _field(entry: Mapping[Any, Any], name: str) -> Any:
    value = entry.get(name)
    return entry.get(name.encode()) if value is None else value
