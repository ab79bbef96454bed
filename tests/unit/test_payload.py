"""Event validation before any write (R1): the bad-input table, round trips, and batches."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outboxkit import EventBus, FrozenClock, InvalidEvent, MemoryStore, Message, Outbox
from outboxkit.core.payload import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    _check_json,
    build_event,
    decode_payload,
)


@dataclass(frozen=True)
class Bad:
    id: str
    match: str  # a regex the error message must match: it names the problem
    topic: Any = "order.placed"
    payload: Any = field(default_factory=dict)
    headers: Any = None
    key: Any = None
    delay: Any = None
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES

    def kwargs(self) -> dict[str, Any]:
        return {"headers": self.headers, "key": self.key, "delay": self.delay}


_cyclic_dict: dict[str, Any] = {"a": 1}
_cyclic_dict["self"] = _cyclic_dict
_cyclic_list: list[Any] = [1]
_cyclic_list.append([_cyclic_list])


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


BAD = [
    # payload: not JSON
    Bad("datetime", r"payload\['at'\] is a datetime", payload={"at": datetime(2030, 1, 1)}),
    Bad("decimal", r"payload\['price'\] is a Decimal", payload={"price": Decimal("1.10")}),
    Bad("set", r"payload is a set", payload={1, 2}),
    Bad("nested-set", r"payload\[1\] is a set", payload=[1, {2}]),
    Bad("bytes", r"payload\['raw'\] is a bytes", payload={"raw": b"\x00"}),
    Bad("object", r"payload is a object", payload=object()),
    Bad("cycle-dict", r"payload\['self'\] refers back to itself", payload=_cyclic_dict),
    Bad("cycle-list", r"refers back to itself", payload=_cyclic_list),
    Bad("nan", r"payload\['x'\] is nan; JSON has no NaN", payload={"x": float("nan")}),
    Bad("inf", r"payload\[0\] is inf", payload=[float("inf")]),
    Bad("minus-inf", r"payload is -inf", payload=float("-inf")),
    Bad("nul-in-string", r"payload\['s'\] contains a NUL", payload={"s": "a\x00b"}),
    Bad("nul-in-key", r"payload key 'a\\x00' contains a NUL", payload={"a\x00": 1}),
    Bad("surrogate-in-string", r"payload\[0\] contains a lone surrogate", payload=["\ud800"]),
    Bad("surrogate-in-key", r"payload key .* contains a lone surrogate", payload={"\udfff": 1}),
    Bad("int-key", r"has a key 1 of type int; JSON object keys must be strings", payload={1: "a"}),
    Bad("none-key", r"has a key None of type NoneType", payload={None: "a"}),
    Bad("tuple-key", r"has a key \('a',\) of type tuple", payload={("a",): 1}),
    Bad("too-deep", r"nests deeper than", payload=_nested(250)),
    Bad("int-too-long", r"cannot be encoded as JSON.*digits", payload={"n": 10**5000}),
    # payload: too large
    Bad(
        "over-limit",
        r"payload is 18 bytes encoded; max_payload_bytes is 16",
        payload="x" * 16,
        max_payload_bytes=16,
    ),
    Bad(
        "over-limit-utf8",
        r"payload is 6 bytes encoded; max_payload_bytes is 5",
        payload="éé",
        max_payload_bytes=5,
    ),
    # topic
    Bad("topic-empty", r"topic must not be empty", topic=""),
    Bad("topic-int", r"topic must be a string, got int", topic=42),
    Bad("topic-none", r"topic must be a string, got NoneType", topic=None),
    Bad("topic-bytes", r"topic must be a string, got bytes", topic=b"order"),
    Bad("topic-too-long", r"topic is 256 characters; the limit is 255", topic="t" * 256),
    Bad("topic-nul", r"topic contains a NUL", topic="order\x00placed"),
    Bad("topic-surrogate", r"topic contains a lone surrogate", topic="order\ud800"),
    # headers
    Bad("headers-list", r"headers must be a mapping of str to str, got list", headers=["a"]),
    Bad("headers-str", r"headers must be a mapping of str to str, got str", headers="a=b"),
    Bad("header-value-int", r"header 'a' must be a string, got int", headers={"a": 1}),
    Bad("header-value-none", r"header 'a' must be a string, got NoneType", headers={"a": None}),
    Bad("header-name-int", r"header name must be a string, got int", headers={1: "a"}),
    Bad("header-name-empty", r"header name must not be empty", headers={"": "a"}),
    Bad("header-name-nul", r"header name contains a NUL", headers={"a\x00": "v"}),
    Bad("header-value-nul", r"header 'a' contains a NUL", headers={"a": "v\x00"}),
    Bad("header-value-surrogate", r"header 'a' contains a lone surrogate", headers={"a": "\ud800"}),
    Bad("header-name-too-long", r"header name is 256 characters", headers={"h" * 256: "v"}),
    # key
    Bad("key-int", r"key must be a string, got int", key=42),
    Bad("key-bytes", r"key must be a string, got bytes", key=b"k"),
    Bad("key-empty", r"key must not be empty", key=""),
    Bad("key-too-long", r"key is 256 characters; the limit is 255", key="k" * 256),
    Bad("key-nul", r"key contains a NUL", key="k\x00"),
    Bad("key-surrogate", r"key contains a lone surrogate", key="\udc00"),
    # delay
    Bad("delay-negative", r"delay must be a finite, non-negative duration, got -1", delay=-1),
    Bad("delay-negative-float", r"non-negative duration, got -0.5", delay=-0.5),
    Bad("delay-negative-timedelta", r"non-negative duration", delay=timedelta(seconds=-1)),
    Bad("delay-nan", r"delay must be a finite.*nan", delay=float("nan")),
    Bad("delay-inf", r"delay must be a finite.*inf", delay=float("inf")),
    Bad("delay-too-large", r"delay 1e\+300 is longer than the limit", delay=1e300),
    Bad("delay-timedelta-max", r"longer than the limit of 3660 days", delay=timedelta.max),
    Bad("delay-str", r"delay must be seconds or a timedelta, got str", delay="5"),
    Bad("delay-bool", r"delay must be seconds or a timedelta, got bool", delay=True),
    # an int too large for a float is a named error, not an OverflowError
    Bad("delay-10**400", r"delay 1000000.* is longer than the limit", delay=10**400),
    Bad("delay--10**400", r"delay must be a finite, non-negative duration", delay=-(10**400)),
    # headers count against max_payload_bytes, with the payload
    Bad(
        "headers-alone-too-large",
        r"headers are 2008 bytes encoded; max_payload_bytes \(payload and headers together\) is 1000",
        headers={"h": "x" * 2000},
        max_payload_bytes=1000,
    ),
    Bad(
        "payload-and-headers-too-large",
        r"payload is 602 bytes encoded and headers 608; max_payload_bytes \(payload and headers "
        r"together\) is 1000",
        payload="y" * 600,
        headers={"h": "x" * 600},
        max_payload_bytes=1000,
    ),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c.id)
def test_build_event_rejects(case: Bad) -> None:
    with pytest.raises(InvalidEvent, match=case.match) as info:
        build_event(
            case.topic,
            case.payload,
            max_payload_bytes=case.max_payload_bytes,
            **case.kwargs(),
        )
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("case", BAD, ids=lambda c: c.id)
def test_enqueue_rejects_and_leaves_the_transaction_usable(
    case: Bad, store: MemoryStore, bus: EventBus, clock: FrozenClock
) -> None:
    outbox = Outbox(store, bus, clock=clock, max_payload_bytes=case.max_payload_bytes)
    tx = store.begin()
    tx.insert("orders", {"id": 1})
    with pytest.raises(InvalidEvent, match=case.match):
        outbox.enqueue(tx, case.topic, case.payload, **case.kwargs())
    # The caller's transaction is untouched: still open, its own writes still pending...
    assert tx.open
    assert tx.rows("orders") == [{"id": 1}]
    # ...and a good enqueue afterwards commits with them; the bad event never existed.
    good = outbox.enqueue(tx, "order.placed", "ok")  # small enough for every case's limit
    tx.commit()
    assert store.rows("orders") == [{"id": 1}]
    assert outbox.stats().total == 1
    event = store.get(good)
    assert event is not None
    assert (event.topic, event.payload) == ("order.placed", "ok")


def test_a_rejected_enqueue_alone_writes_nothing(outbox: Outbox, store: MemoryStore) -> None:
    with store.transaction() as tx, pytest.raises(InvalidEvent):
        outbox.enqueue(tx, "t", {"x": float("nan")})
    assert outbox.stats().total == 0
    assert store.get(1) is None


# -- good payloads ------------------------------------------------------------------------------

GOOD = {
    "unicode": {
        "name": "Zoë",
        "jp": "日本語",
        "emoji": "🎉👍🏽",
        "seps": "\u2028\u2029",
        "é": "ключ",
    },
    "escapes": {"quote": '"', "backslash": "\\", "newline": "a\nb", "tab": "\t", "ctrl": "\x01"},
    "nested": {"a": [{"b": [1, [2, [3, {"c": None, "d": []}]]]}], "e": {}},
    "deep": _nested(150),
    "big-ints": {"u64": 2**64, "neg": -(2**100), "huge": 10**4000, "zero": 0},
    "floats": {"tenth": 0.1, "max": 1.7976931348623157e308, "tiny": 5e-324, "neg": -2.5e-10},
    "scalars": [None, True, False, 0, -1, "", "s", 1.5],
    "empty-object": {},
    "empty-list": [],
    "string": "just a string",
    "null": None,
    "number": 42,
}


@pytest.mark.parametrize("payload", list(GOOD.values()), ids=list(GOOD))
def test_good_payload_round_trips(outbox: Outbox, store: MemoryStore, payload: Any) -> None:
    built = build_event("t", payload)
    assert json.loads(built.payload_json) == payload
    assert decode_payload(built.payload_json) == payload
    with store.transaction() as tx:
        event_id = outbox.enqueue(tx, "t", payload)
    event = store.get(event_id)
    assert event is not None
    assert event.payload == payload


def test_floats_round_trip_bit_for_bit(outbox: Outbox, store: MemoryStore) -> None:
    values = [0.1, 1 / 3, 1e-7, 123456789.123456789, -0.0, 2.0**-1074]
    with store.transaction() as tx:
        event_id = outbox.enqueue(tx, "t", values)
    event = store.get(event_id)
    assert event is not None
    assert [v.hex() for v in event.payload] == [v.hex() for v in values]


def test_tuples_become_lists_and_shared_references_are_not_cycles(
    outbox: Outbox, store: MemoryStore
) -> None:
    shared = [1, 2]
    with store.transaction() as tx:
        event_id = outbox.enqueue(tx, "t", {"pair": (1, "a"), "x": shared, "y": shared})
    event = store.get(event_id)
    assert event is not None
    assert event.payload == {"pair": [1, "a"], "x": [1, 2], "y": [1, 2]}


def test_non_ascii_is_stored_unescaped() -> None:
    assert build_event("t", {"é": "日本"}).payload_json == '{"é":"日本"}'


def test_payload_limit_counts_utf8_bytes_and_is_inclusive() -> None:
    assert build_event("t", "abc", max_payload_bytes=5).payload_json == '"abc"'
    with pytest.raises(InvalidEvent, match="5 bytes encoded; max_payload_bytes is 4"):
        build_event("t", "abc", max_payload_bytes=4)
    assert build_event("t", "é", max_payload_bytes=4).payload_json == '"é"'  # 2 + 2 bytes
    with pytest.raises(InvalidEvent, match="4 bytes encoded; max_payload_bytes is 3"):
        build_event("t", "é", max_payload_bytes=3)


def test_default_limit_is_one_mebibyte() -> None:
    assert DEFAULT_MAX_PAYLOAD_BYTES == 1024 * 1024
    just_fits = "x" * (DEFAULT_MAX_PAYLOAD_BYTES - 2)  # plus two quotes
    assert len(build_event("t", just_fits).payload_json) == DEFAULT_MAX_PAYLOAD_BYTES
    with pytest.raises(InvalidEvent, match="max_payload_bytes is 1048576"):
        build_event("t", just_fits + "x")


def test_limits_and_boundaries_that_are_allowed() -> None:
    event = build_event("t" * 255, {}, headers={"h" * 255: ""}, key="k" * 255, delay=0)
    assert (len(event.topic), len(event.key or ""), event.delay) == (255, 255, timedelta(0))
    assert event.headers == {"h" * 255: ""}


def test_headers_key_and_delay_are_stored(
    outbox: Outbox, store: MemoryStore, clock: FrozenClock
) -> None:
    with store.transaction() as tx:
        a = outbox.enqueue(tx, "t", {}, headers={"trace": "abc"}, key="order-1", delay=5)
        b = outbox.enqueue(tx, "t", {}, delay=timedelta(minutes=1))
        c = outbox.enqueue(tx, "t", {})
    ea, eb, ec = store.get(a), store.get(b), store.get(c)
    assert ea is not None
    assert eb is not None
    assert ec is not None
    assert (ea.headers, ea.key) == ({"trace": "abc"}, "order-1")
    assert ea.available_at == datetime(2030, 1, 1, 0, 0, 5, tzinfo=UTC)
    assert eb.available_at == clock.now() + timedelta(minutes=1)
    assert (ec.headers, ec.key, ec.available_at) == ({}, None, clock.now())


BAD_HEADERS: Any = {"h": 1}

# -- enqueue_many -------------------------------------------------------------------------------


def test_enqueue_many_writes_all_in_order(outbox: Outbox, store: MemoryStore) -> None:
    with store.transaction() as tx:
        ids = outbox.enqueue_many(
            tx,
            [
                ("a", {"n": 1}),
                Message("b", [2], headers={"h": "v"}, key="k", delay=3),
                ("c", None),
            ],
        )
    assert len(ids) == 3
    assert ids == sorted(ids)
    events = [store.get(i) for i in ids]
    assert [(e.topic, e.payload) for e in events if e is not None] == [
        ("a", {"n": 1}),
        ("b", [2]),
        ("c", None),
    ]
    assert events[1] is not None
    assert (events[1].headers, events[1].key) == ({"h": "v"}, "k")


def test_enqueue_many_accepts_any_iterable_and_nothing(outbox: Outbox, store: MemoryStore) -> None:
    with store.transaction() as tx:
        assert outbox.enqueue_many(tx, []) == []
        ids = outbox.enqueue_many(tx, (("t", {"i": i}) for i in range(3)))
    assert [e.payload for i in ids if (e := store.get(i)) is not None] == [
        {"i": 0},
        {"i": 1},
        {"i": 2},
    ]


@pytest.mark.parametrize(
    ("events", "match"),
    [
        ([("a", {}), ("b", {}), ("c", {"x": float("nan")})], r"event #2: payload\['x'\] is nan"),
        ([("", {}), ("b", {})], r"event #0: topic must not be empty"),
        ([("a", {}), Message("b", {}, key="")], r"event #1: key must not be empty"),
        ([("a", {}), Message("b", {}, delay=-1)], r"event #1: delay must be a finite"),
        ([("a", {}), Message("b", {}, headers=BAD_HEADERS)], r"event #1: header 'h' must be"),
        ([("a", {}), 42], r"event #1: expected a Message or a \(topic, payload\) pair"),
        ([("a", {}, "extra")], r"event #0: expected a Message"),
        ([["a", {}]], r"event #0: expected a Message"),
    ],
)
def test_enqueue_many_validates_everything_before_writing(
    outbox: Outbox, store: MemoryStore, events: list[Any], match: str
) -> None:
    tx = store.begin()
    with pytest.raises(InvalidEvent, match=match):
        outbox.enqueue_many(tx, events)
    assert tx.open
    good = outbox.enqueue_many(tx, [("ok", {"fine": True})])
    tx.commit()
    assert outbox.stats().total == 1
    event = store.get(good[0])
    assert event is not None
    assert event.topic == "ok"


# -- the fast path agrees with the precise walk -------------------------------------------------


def _reference_encode(payload: object) -> str:
    """The validation as the precise walk alone does it (the fast path's oracle)."""
    _check_json(payload, "payload", 0, set())
    return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class _Str(str):
    pass


class _Int(int):
    pass


class _Dict(dict[Any, Any]):
    pass


_awkward_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN and infinities included
    st.text(),  # NUL, lone surrogates included
    st.sampled_from(["\\u0000", "a\x00b", "\ud800", "é", "", _Str("s"), _Int(3)]),
    st.sampled_from([Decimal("1.5"), b"x", {1, 2}, datetime(2026, 1, 1, tzinfo=UTC)]),
)
_awkward_keys = st.one_of(
    st.text(max_size=5), st.integers(), st.none(), st.booleans(), st.just(_Str("k"))
)
_awkward = st.recursive(
    _awkward_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_awkward_keys, inner, max_size=4),
        st.dictionaries(_awkward_keys, inner, max_size=2).map(_Dict),
    ),
    max_leaves=12,
)


def _outcome(encode: Callable[[], str]) -> tuple[str, str]:
    """("encoded", text) or ("refused", the InvalidEvent message)."""
    try:
        return "encoded", encode()
    except InvalidEvent as exc:
        return "refused", str(exc)


@settings(max_examples=1500, deadline=None)
@given(_awkward)
def test_the_fast_path_agrees_with_the_precise_walk(payload: object) -> None:
    """``build_event`` lets the C encoder check the common case and sends anything odd through
    the walk; on any payload it accepts exactly what the walk accepts, encodes it to the same
    text, and refuses the rest with the walk's own message."""
    assert _outcome(lambda: build_event("t", payload).payload_json) == _outcome(
        lambda: _reference_encode(payload)
    )


@pytest.mark.parametrize(
    ("payload", "refused"),
    [
        (_nested(201), True),
        (_cyclic_dict, True),
        (_cyclic_list, True),
        ({"a": [{"b": {1: 2}}]}, True),
        ({"k": "\\u0000"}, False),
        ({"k": "a\x00b"}, True),
        ({"k": "\ud800"}, True),
    ],
    ids=[
        "too-deep",
        "cyclic-dict",
        "cyclic-list",
        "nested-int-key",
        "literal-backslash-u0000",
        "nul",
        "lone-surrogate",
    ],
)
def test_the_fast_path_agrees_on_the_awkward_shapes(payload: object, refused: bool) -> None:
    got = _outcome(lambda: build_event("t", payload).payload_json)
    assert got == _outcome(lambda: _reference_encode(payload))
    assert (got[0] == "refused") is refused
