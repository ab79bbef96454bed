"""Topic patterns and relay subscriptions on the bus."""

from __future__ import annotations

import pytest

from outboxkit import EventBus
from outboxkit.bus import TopicPattern
from outboxkit.errors import ConfigurationError


class NullRelay:
    async def publish(self, events):
        return [None] * len(events)

    def publish_blocking(self, events):
        return [None] * len(events)


@pytest.mark.parametrize(
    ("pattern", "topic", "matches"),
    [
        ("order.*", "order.placed", True),
        ("order.*", "order", False),
        ("order.*", "order.placed.eu", False),
        ("order.#", "order", True),
        ("order.#", "order.placed", True),
        ("order.#", "order.placed.eu", True),
        ("order.#", "orders.placed", False),
        ("#", "anything", True),
        ("#", "any.thing.at.all", True),
        ("#.placed", "placed", True),
        ("#.placed", "order.placed", True),
        ("#.placed", "order.placed.eu", False),
        ("a.#.z", "a.z", True),
        ("a.#.z", "a.b.c.z", True),
        ("a.#.z", "a.b.c", False),
        ("*.placed", "order.placed", True),
        ("*.placed", "placed", False),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.c", False),
        ("order.placed", "order.placed", True),
        ("order.placed", "order.placedX", False),
        ("order.placed", "orderXplaced", False),  # a dot is a dot, not any character
        ("a+b.(c)", "a+b.(c)", True),  # regex characters are literal
    ],
)
def test_a_pattern_matches_by_dot_separated_words(pattern, topic, matches):
    assert TopicPattern(pattern).matches(topic) is matches


@pytest.mark.parametrize("bad", ["", "order..placed", ".order", "order.", "order.pl*", "a#", 7])
def test_a_bad_pattern_is_refused_naming_it(bad):
    with pytest.raises(ConfigurationError, match="topic pattern"):
        TopicPattern(bad)


def test_exact_handlers_come_first_then_relays_in_subscription_order():
    bus = EventBus()
    bus.relay(NullRelay(), topics=["order.#"], name="r1")
    bus.subscribe("order.placed", lambda e, c: None, name="h1")
    bus.relay(NullRelay(), topics=["*.placed", "order.*"], name="r2")  # matches twice: once
    bus.subscribe("order.placed", lambda e, c: None, name="h2")
    assert bus.names_for("order.placed") == ("h1", "h2", "r1", "r2")
    assert bus.names_for("order.placed.eu") == ("r1",)
    assert bus.names_for("invoice.sent") == ()
    assert bus.find("r2").topic == "*.placed,order.*"
    assert [s.name for s in bus.specs()] == ["h1", "h2", "r1", "r2"]


def test_a_subscription_after_a_lookup_is_seen():
    bus = EventBus()
    bus.relay(NullRelay(), topics=["a.*"], name="r1")
    assert bus.names_for("a.b") == ("r1",)
    bus.relay(NullRelay(), topics=["#"], name="r2")
    bus.subscribe("a.b", lambda e, c: None, name="h")
    assert bus.names_for("a.b") == ("h", "r1", "r2")


def test_relay_names_are_unique_on_the_whole_bus():
    bus = EventBus()
    bus.subscribe("x", lambda e, c: None, name="taken")
    with pytest.raises(ConfigurationError, match="'taken'"):
        bus.relay(NullRelay(), topics=["y"], name="taken")
    bus.relay(NullRelay(), topics=["y"], name="relay")
    with pytest.raises(ConfigurationError, match="'relay'"):
        bus.subscribe("z", lambda e, c: None, name="relay")
    with pytest.raises(ConfigurationError, match="'relay'"):
        bus.relay(NullRelay(), topics=["w"], name="relay")


@pytest.mark.parametrize(
    ("relay", "topics", "name", "message"),
    [
        (NullRelay(), "order.*", "r", "list of topics"),
        (NullRelay(), [], "r", "at least one"),
        (object(), ["a"], "r", "no publish"),
        (NullRelay(), ["a"], "", "relay name"),
        (NullRelay(), ["a"], "x\x00", "relay name"),
    ],
)
def test_a_bad_relay_subscription_is_refused(relay, topics, name, message):
    with pytest.raises(ConfigurationError, match=message):
        EventBus().relay(relay, topics=topics, name=name)
