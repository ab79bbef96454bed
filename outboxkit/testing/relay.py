"""``TestRelay``: a relay without a broker, for an app's tests.

It records every message that would have been published (``messages``), built as the real
relays build them (``outboxkit.relay.message_of``: body, headers, message id), and answers
event by event as a broker would, with the failures a test asks for::

    relay = TestRelay()
    relay.nack(topic="order.placed")           # the broker refuses the first one
    relay.time_out(event_id=3)                 # sent, but its confirm never comes
    relay.lose_connection(topic="refund.*")    # the link drops: it and the rest of its batch fail
    outbox_drain.use_relay(relay)              # every relay of the app's bus publishes here
    report = outbox_drain(raise_errors=False)

A timed-out message did reach the broker (it is in ``messages``) and is published again on
the retry, with the same message id: what a consumer's dedupe (``Inbox``) is for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..bus import EventBus, TopicPattern
from ..core.model import Event
from ..errors import ConfigurationError, RelayError
from ..outbox import Outbox
from ..relay import Destination, RelayMessage, message_of, topic_destination

__all__ = ["TestRelay"]

_KINDS = ("nack", "timeout", "connection")


@dataclass
class _Fault:
    kind: str
    topic: TopicPattern | None
    event_id: int | None
    times: int
    struck: int = 0

    def aims_at(self, event: Event) -> bool:
        return (
            self.struck < self.times
            and (self.topic is None or self.topic.matches(event.topic))
            and (self.event_id is None or event.id == self.event_id)
        )


@dataclass
class TestRelay:
    """A broker-less relay that records what it would publish (see the module docstring).

    Args:
        destination: where a message goes (the topic by default), as for the real relays.

    Attributes:
        messages: every message the broker got, in order (a re-published one again).
        refused: the messages it refused or that were lost, with the error, in order.
    """

    __test__ = False  # not a pytest test class, whatever its name

    destination: Destination = topic_destination
    messages: list[RelayMessage] = field(default_factory=list)
    refused: list[tuple[RelayMessage, RelayError]] = field(default_factory=list)
    _faults: list[_Fault] = field(default_factory=list, repr=False)

    # -- what to fail ---------------------------------------------------------------------------

    def nack(
        self, *, topic: str | None = None, event_id: int | None = None, times: int = 1
    ) -> None:
        """The broker refuses the next ``times`` matching messages (not published)."""
        self._add("nack", topic, event_id, times)

    def time_out(
        self, *, topic: str | None = None, event_id: int | None = None, times: int = 1
    ) -> None:
        """The next ``times`` matching messages reach the broker but their confirm never
        comes: they fail, and are published again on the retry."""
        self._add("timeout", topic, event_id, times)

    def lose_connection(
        self, *, topic: str | None = None, event_id: int | None = None, times: int = 1
    ) -> None:
        """The link drops at the next ``times`` matching messages: each, and every later one
        of its batch, fails unpublished."""
        self._add("connection", topic, event_id, times)

    def _add(self, kind: str, topic: str | None, event_id: int | None, times: int) -> None:
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise ConfigurationError(f"times must be an integer >= 1, got {times!r}")
        pattern = TopicPattern(topic) if topic is not None else None
        self._faults.append(_Fault(kind, pattern, event_id, times))

    # -- reading --------------------------------------------------------------------------------

    def published(self, destination: str | None = None) -> list[RelayMessage]:
        """The messages the broker got (to ``destination`` only, when given), in order."""
        return [m for m in self.messages if destination is None or m.destination == destination]

    def message_ids(self) -> list[str]:
        """The message ids the broker got, in order (a re-published message twice)."""
        return [m.message_id for m in self.messages]

    # -- the Relay protocol ---------------------------------------------------------------------

    async def publish(self, events: Sequence[Event]) -> list[Exception | None]:
        """See ``outboxkit.relay.Relay.publish``."""
        return self.publish_blocking(events)

    def publish_blocking(self, events: Sequence[Event]) -> list[Exception | None]:
        """See ``outboxkit.relay.Relay.publish_blocking``."""
        results: list[Exception | None] = []
        lost: RelayError | None = None
        for event in events:
            message = message_of(event, self.destination)
            if lost is not None:
                self.refused.append((message, lost))
                results.append(lost)
                continue
            fault = next((f for f in self._faults if f.aims_at(event)), None)
            if fault is None:
                self.messages.append(message)
                results.append(None)
                continue
            fault.struck += 1
            if fault.kind == "timeout":
                self.messages.append(message)  # the broker has it; the confirm is what is lost
                error = RelayError(f"TestRelay: no confirm for event {event.id} (injected)")
            elif fault.kind == "nack":
                error = RelayError(f"TestRelay: broker nacked event {event.id} (injected)")
            else:
                error = RelayError(f"TestRelay: connection lost at event {event.id} (injected)")
                lost = error
            self.refused.append((message, error))
            results.append(error)
        return results

    # -- standing in for the app's relays -------------------------------------------------------

    def bound(self, outbox: Outbox, names: Sequence[str] | None = None) -> Outbox:
        """A copy of ``outbox`` whose relays (those named, or all) publish to this relay
        instead, on the same topics and under the same names (so the same records)."""
        bus = EventBus()
        replaced = 0
        for spec in outbox.bus.specs():
            if spec.relay is not None and (names is None or spec.name in names):
                bus.relay(self, topics=[p.text for p in spec.patterns], name=spec.name)
                replaced += 1
            elif spec.relay is not None:
                bus.relay(spec.relay, topics=[p.text for p in spec.patterns], name=spec.name)
            else:
                bus.subscribe(spec.topic, spec.fn, name=spec.name, transactional=spec.transactional)
        if not replaced:
            raise ConfigurationError(
                f"use_relay: the bus has no relay{' named ' + repr(list(names)) if names else ''} "
                "to stand in for (bus.relay(...) subscribes one)"
            )
        copy = outbox.rebind()
        copy.bus = bus
        return copy
