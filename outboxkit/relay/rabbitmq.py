"""The RabbitMQ relay (``outboxkit[rabbitmq]``, aio-pika): publisher confirms, persistent
messages, mandatory routing.

Each event becomes one persistent message on ``exchange`` with routing key
``destination(event)`` (the topic by default), ``message_id`` the event's message identity
(``Event.message_id``, also in the ``outbox-message-id`` header), ``type`` the topic,
``content_type`` ``application/json``, and the headers of ``outboxkit.relay.RelayMessage``.
The batch is published on one channel in publisher-confirm mode and its confirms awaited
together. A message is *mandatory*: one the exchange routes to
no queue comes back, and its event fails with ``Unroutable`` (retried, then dead-lettered),
never recorded as delivered. A nack fails its event with ``RelayError``.

Order: one channel publishes a batch in claim order, so a queue receives a batch's events in
that order. To keep each key's events together on one queue of several, bind the queues to an
``x-consistent-hash`` exchange and pass ``destination=lambda event: event.key or event.topic``.

Consumer side: ``event_id(message)`` reads the message identity back; with
``outboxkit.relay.inbox.Inbox`` the consumer applies each message once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError, RelayError, Unroutable
from . import (
    EVENT_ID_HEADER,
    MESSAGE_ID_HEADER,
    BrokerRelay,
    Destination,
    RelayMessage,
    client_module,
    parse_message_id,
    topic_destination,
)

if TYPE_CHECKING:
    import aio_pika
    from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

__all__ = ["RabbitMQRelay", "event_id"]


def _aio_pika() -> Any:
    return client_module("aio_pika", "rabbitmq")


@dataclass(slots=True)
class _Link:
    connection: AbstractConnection
    channel: AbstractChannel
    exchange: AbstractExchange


class RabbitMQRelay(BrokerRelay[_Link]):
    """Publishes events to a RabbitMQ exchange, with confirms (see the module docstring).

    Args:
        url: ``amqp://user:password@host:port/vhost``.
        exchange: the exchange to publish to; it must exist (the app declares its topology).
            ``""`` is the default exchange: the routing key is then a queue's name.
        destination: the routing key of an event; its topic by default.
        confirm_timeout: seconds to wait for a batch's confirms.

    Raises:
        ConfigurationError: a bad option, naming it.
        MissingDependency: aio-pika is not installed.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str,
        destination: Destination = topic_destination,
        confirm_timeout: float = 10.0,
    ) -> None:
        _aio_pika()
        super().__init__(url, destination=destination, confirm_timeout=confirm_timeout)
        if not isinstance(exchange, str):
            raise ConfigurationError(f"exchange must be a string, got {exchange!r:.80}")
        self.exchange = exchange

    async def _connect(self) -> _Link:
        aio_pika = _aio_pika()
        connection = await aio_pika.connect(self.url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if self.exchange:
                exchange = await channel.get_exchange(self.exchange, ensure=True)
            else:
                exchange = channel.default_exchange
        except BaseException:
            await connection.close()
            raise
        return _Link(connection, channel, exchange)

    async def _send(self, link: _Link, messages: Sequence[RelayMessage]) -> list[Exception | None]:
        aio_pika = _aio_pika()
        persistent = aio_pika.DeliveryMode.PERSISTENT
        publishes = [
            asyncio.ensure_future(
                link.exchange.publish(
                    aio_pika.Message(
                        message.body,
                        headers=dict(message.headers),
                        message_id=message.message_id,
                        type=message.headers["outbox-topic"],
                        content_type="application/json",
                        delivery_mode=persistent,
                    ),
                    message.destination,
                    mandatory=True,
                )
            )
            for message in messages
        ]
        answers = await self._confirms(publishes)
        return [self._answer(m, a) for m, a in zip(messages, answers, strict=True)]

    def _refusal(self, message: RelayMessage, exc: Exception) -> RelayError | None:
        exceptions = _aio_pika().exceptions
        if isinstance(exc, exceptions.PublishError):
            return Unroutable(
                f"RabbitMQ returned event {message.event_id}: exchange {self.exchange!r} routes "
                f"{message.destination!r} to no queue"
            )
        if isinstance(exc, exceptions.DeliveryError):
            return RelayError(
                f"RabbitMQ nacked event {message.event_id} ({message.destination!r})",
                refused=True,
            )
        return None

    async def _disconnect(self, link: _Link) -> None:
        await link.connection.close()


def event_id(message: aio_pika.abc.AbstractIncomingMessage) -> str:
    """The message identity of a consumed message (its ``message_id``, else its
    ``outbox-message-id`` or, sent before the stores kept message ids, ``outbox-event-id``
    header), the dedupe key (``Inbox.accept``).

    Returns:
        A UUID's text, or the decimal event id of a message sent before the upgrade.

    Raises:
        ValueError: the message was not sent by a relay (no id, or not one of those forms).
    """
    headers = message.headers or {}
    return parse_message_id(
        message.message_id, headers.get(MESSAGE_ID_HEADER), headers.get(EVENT_ID_HEADER)
    )
