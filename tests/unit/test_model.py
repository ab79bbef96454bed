"""Value objects of ``outboxkit.core.model`` that say something to an operator."""

from __future__ import annotations

import json
import pickle
from dataclasses import FrozenInstanceError, dataclass, replace
from datetime import UTC, datetime

import pytest

from outboxkit import Event, Migration
from outboxkit.core.model import (
    Claim,
    Delivery,
    Outcome,
    StoredJSON,
    UndecodablePayload,
    decode_payload,
    make_claim,
    make_delivery,
    make_event,
    payload_is_undecodable,
    quick_maker,
    stored_payload_text,
)
from outboxkit.relay import message_of, topic_destination


@pytest.mark.parametrize(
    ("before", "after", "said", "changed"),
    [
        (0, 4, "created schema v4", True),
        (2, 4, "upgraded 2 -> 4", True),
        (4, 4, "already at v4", False),
    ],
)
def test_a_migration_says_what_it_did(before: int, after: int, said: str, changed: bool) -> None:
    done = Migration(before=before, after=after)
    assert str(done) == said
    assert done.changed is changed


# -- a payload the store vouches is JSON, decoded on first read ----------------------------------


def stored_event(text: str) -> Event:
    return Event(id=7, topic="order.placed", payload=StoredJSON(text))


def test_a_stored_payload_is_decoded_on_first_read_and_kept() -> None:
    event = stored_event('{"order_id": 7, "items": [1, 2]}')
    assert stored_payload_text(event) == '{"order_id": 7, "items": [1, 2]}'
    first = event.payload
    assert first == {"order_id": 7, "items": [1, 2]}
    assert event.payload is first  # decoded once
    assert stored_payload_text(event) is None  # what a handler may have changed is not re-sent


def test_a_stored_payload_compares_copies_and_pickles_as_its_value() -> None:
    event = stored_event('{"a": 1}')
    plain = Event(id=7, topic="order.placed", payload={"a": 1})
    assert stored_event('{"a": 1}') == plain
    assert repr(stored_event('{"a": 1}')) == repr(plain)
    assert replace(stored_event('{"a": 1}'), attempts=2).payload == {"a": 1}
    assert pickle.loads(pickle.dumps(event)) == plain
    with pytest.raises(FrozenInstanceError):
        event.payload = {"b": 2}  # type: ignore[misc]


def test_the_undecodable_check_leaves_a_stored_payload_undecoded() -> None:
    event = stored_event('{"a": 1}')
    assert payload_is_undecodable(event) is False
    assert stored_payload_text(event) == '{"a": 1}'
    broken = Event(id=8, topic="t", payload=decode_payload("{not json"))
    assert payload_is_undecodable(broken) is True
    assert isinstance(broken.payload, UndecodablePayload)
    assert "not valid JSON" in broken.payload.error


def test_a_relay_sends_a_stored_payload_as_stored_and_a_decoded_one_encoded() -> None:
    destination = topic_destination
    assert message_of(stored_event('{"a": 1, "b": "Zoë"}'), destination).body == (
        '{"a": 1, "b": "Zoë"}'.encode()
    )
    read = stored_event('{"a": 1}')
    read.payload["a"] = 2  # a handler before the relay changed it: the change is sent
    assert json.loads(message_of(read, destination).body) == {"a": 2}


# -- the hot paths' makers -----------------------------------------------------------------------

AT = datetime(2030, 1, 1, tzinfo=UTC)


def test_the_quick_makers_make_what_the_classes_make() -> None:
    """Same type, fields, equality, hash, repr, pickling and immutability as a call of the
    class, positionally or by keyword, defaults included."""
    made = make_event(7, "order.placed", StoredJSON('{"a": 1}'), {}, "k", AT, AT, 2)
    event = Event(7, "order.placed", {"a": 1}, {}, "k", AT, AT, 2)
    assert type(made) is Event
    assert made == event and repr(made) == repr(event)
    assert made.payload == {"a": 1} and made.state is event.state
    assert pickle.loads(pickle.dumps(made)) == event
    assert replace(made, attempts=3) == replace(event, attempts=3)
    with pytest.raises(FrozenInstanceError):
        made.attempts = 9  # type: ignore[misc]
    claim = make_claim(event=made, token="t", locked_until=AT)
    assert type(claim) is Claim and claim == Claim(event, "t", AT) and claim.done == {}
    delivery = make_delivery(7, "order.placed", "h", 2, Outcome.SUCCEEDED, AT)
    assert delivery == Delivery(7, "order.placed", "h", 2, Outcome.SUCCEEDED, AT)
    assert hash(delivery) == hash(Delivery(7, "order.placed", "h", 2, Outcome.SUCCEEDED, AT))
    assert delivery.error is None and delivery.exception is None
    with pytest.raises(TypeError):
        make_delivery(7, "order.placed")  # missing fields: refused as the class refuses them


def test_a_quick_maker_refuses_a_class_with_a_post_init() -> None:
    @dataclass(frozen=True, slots=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            if self.value < 0:
                raise ValueError(self.value)

    with pytest.raises(TypeError, match="Checked has a __post_init__"):
        quick_maker(Checked)


def test_an_events_message_id_is_its_stored_identity_else_its_decimal_id() -> None:
    """``message_id`` is what a store drew (a UUID's text); a row older than the column (the
    store hands over None) and an event built by hand without one have their decimal id, the
    identity their messages carried before. It survives the quick maker, pickling and
    ``replace``, and is not part of equality (it is random)."""
    drawn = "0b4f7d9e-5c1a-4e2b-9f3d-7a6c5b4e3d2c"
    made = make_event(7, "t", {}, {}, None, AT, AT, 1, None, None, None, None, drawn)
    legacy = make_event(7, "t", {}, {}, None, AT, AT, 1, None, None, None, None, None)
    by_hand = Event(7, "t", {}, {}, None, AT, AT, 1)
    assert made.message_id == drawn
    assert legacy.message_id == by_hand.message_id == "7"
    assert made == legacy == by_hand  # random: equality leaves it out
    assert pickle.loads(pickle.dumps(made)).message_id == drawn
    assert replace(made, attempts=2).message_id == drawn
    assert replace(legacy, attempts=2).message_id == "7"
    assert f"message_id={drawn!r}" in repr(made)
    assert message_of(made, topic_destination).message_id == drawn
    assert message_of(legacy, topic_destination).headers["outbox-message-id"] == "7"
    with pytest.raises(FrozenInstanceError):
        made.message_id = "x"  # type: ignore[misc]
