"""Validation of events before any SQL runs (R1).

PURE: no I/O. Every check here runs before a store sees the event, so a bad event raises
``InvalidEvent`` and the caller's transaction is untouched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from types import MappingProxyType

from ..errors import InvalidEvent
from .model import NewEvent, decode_payload

__all__ = ["DEFAULT_MAX_PAYLOAD_BYTES", "MAX_TOPIC_LENGTH", "build_event", "decode_payload"]

DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
MAX_TOPIC_LENGTH = 255
MAX_KEY_LENGTH = 255
_MAX_DEPTH = 200
MAX_DELAY = timedelta(days=3660)  # ten years; keeps now + delay far from datetime's limits


def build_event(
    topic: object,
    payload: object,
    *,
    headers: object = None,
    key: object = None,
    delay: object = None,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    dedupe_key: object = None,
    available_at: object = None,
) -> NewEvent:
    """Validate one event and serialise its payload.

    Raises:
        InvalidEvent: naming the bad part - a topic that is not a short non-empty string,
            a payload that is not plain JSON (NaN/Infinity, NUL characters, lone surrogates,
            non-JSON types, cycles) or is larger than ``max_payload_bytes``, headers that are not
            a str->str mapping, a key or dedupe key that is not a short string, a negative or
            non-finite delay, an ``available_at`` that is not an aware datetime, or both
            ``delay`` and ``available_at``.
    """
    if dedupe_key is not None or available_at is not None:
        plain = build_event(
            topic,
            payload,
            headers=headers,
            key=key,
            delay=delay,
            max_payload_bytes=max_payload_bytes,
        )
        if dedupe_key is not None and not _plain_text(dedupe_key, MAX_KEY_LENGTH):
            _check_text("dedupe_key", dedupe_key, MAX_KEY_LENGTH, allow_empty=False)
        assert dedupe_key is None or isinstance(dedupe_key, str)
        if available_at is not None and delay is not None:
            raise InvalidEvent(
                f"give delay or available_at, not both (delay={delay!r:.40}, "
                f"available_at={available_at!r:.40})"
            )
        return replace(plain, dedupe_key=dedupe_key, available_at=_check_available_at(available_at))
    if not _plain_text(topic, MAX_TOPIC_LENGTH):
        _check_text("topic", topic, MAX_TOPIC_LENGTH, allow_empty=False)
    assert isinstance(topic, str)
    if key is not None and not _plain_text(key, MAX_KEY_LENGTH):
        _check_text("key", key, MAX_KEY_LENGTH, allow_empty=False)
    assert key is None or isinstance(key, str)
    if headers is None:
        return NewEvent(
            topic,
            _encode_payload(payload, max_payload_bytes),
            _NO_HEADERS,
            key,
            _NO_DELAY if delay is None else _check_delay(delay),
        )
    checked = _check_headers(headers)
    # The headers count against the same limit as the payload: together they are the row.
    room = max_payload_bytes - _encoded_size(checked)
    if room < 0:
        raise InvalidEvent(
            f"headers are {max_payload_bytes - room} bytes encoded; max_payload_bytes "
            f"(payload and headers together) is {max_payload_bytes}"
        )
    return NewEvent(
        topic,
        _encode_payload(payload, room, limit=max_payload_bytes),
        checked,
        key,
        _NO_DELAY if delay is None else _check_delay(delay),
    )


def _encoded_size(headers: Mapping[str, str]) -> int:
    if not headers:
        return 0
    text = _dumps(dict(headers))
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _plain_text(value: object, max_length: int) -> bool:
    """True for the common case the checks would pass at once: a non-empty ``str`` of ASCII
    without NUL within ``max_length`` (False sends it through ``_check_text``)."""
    return (
        type(value) is str
        and 0 < len(value) <= max_length
        and value.isascii()
        and "\x00" not in value
    )


def _check_text(what: str, value: object, max_length: int, *, allow_empty: bool) -> None:
    if not isinstance(value, str):
        raise InvalidEvent(f"{what} must be a string, got {type(value).__name__}: {value!r:.80}")
    if not value and not allow_empty:
        raise InvalidEvent(f"{what} must not be empty")
    if len(value) > max_length:
        raise InvalidEvent(f"{what} is {len(value)} characters; the limit is {max_length}")
    _check_string(what, value)


def _check_string(where: str, value: str) -> None:
    if "\x00" in value:
        raise InvalidEvent(f"{where} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEvent(f"{where} contains a lone surrogate ({exc.reason})") from None


def _check_headers(headers: object) -> Mapping[str, str]:
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidEvent(f"headers must be a mapping of str to str, got {type(headers).__name__}")
    checked: dict[str, str] = {}
    for name, value in headers.items():
        _check_text("header name", name, MAX_TOPIC_LENGTH, allow_empty=False)
        if not isinstance(value, str):
            raise InvalidEvent(f"header {name!r} must be a string, got {type(value).__name__}")
        _check_string(f"header {name!r}", value)
        checked[name] = value
    return checked


_NO_DELAY = timedelta(0)
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


def _check_available_at(available_at: object) -> datetime | None:
    if available_at is None:
        return None
    if not isinstance(available_at, datetime):
        raise InvalidEvent(
            f"available_at must be an aware datetime, got {type(available_at).__name__}: "
            f"{available_at!r:.60}"
        )
    if available_at.tzinfo is None or available_at.utcoffset() is None:
        raise InvalidEvent(
            f"available_at must be timezone-aware (naive datetimes are refused), got "
            f"{available_at!r:.60}"
        )
    return available_at


def _check_delay(delay: object) -> timedelta:
    if delay is None:
        return _NO_DELAY
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        try:
            seconds = float(delay)
        except OverflowError:  # an int too large for a float
            seconds = MAX_DELAY.total_seconds() + 1 if delay > 0 else -1.0
    else:
        raise InvalidEvent(f"delay must be seconds or a timedelta, got {type(delay).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidEvent(f"delay must be a finite, non-negative duration, got {delay!r:.40}")
    if seconds > MAX_DELAY.total_seconds():
        raise InvalidEvent(f"delay {delay!r:.40} is longer than the limit of {MAX_DELAY.days} days")
    return delay if isinstance(delay, timedelta) else timedelta(seconds=seconds)


def _compact_encoder() -> Callable[[object], str]:
    """Compact JSON, non-ASCII kept as is, NaN and Infinity refused.

    ``JSONEncoder.encode`` builds a new C encoder on every call (1.35 of its 3.1 us for a small
    payload, measured); this one is built once. It runs without the circular check: every
    payload has been walked by ``_plain_shape`` (or ``_check_json``) first, and a cycle ends
    there as too deep. Where the C encoder is missing, or does not answer as the standard one
    does, the standard one is used.
    """
    standard = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return standard.encode
    try:
        encoder = make(
            None, standard.default, json.encoder.encode_basestring, None, ":", ",",
            False, False, False,
        )  # fmt: skip
        sample = {"a": [1, 2.5, None, True, "é\n"], "b": {}}

        def dumps(value: object) -> str:
            return "".join(encoder(value, 0))

        if dumps(sample) != standard.encode(sample):
            return standard.encode
    except Exception:  # another Python's C encoder: keep the standard one
        return standard.encode
    return dumps


_dumps = _compact_encoder()


def _encode_payload(payload: object, max_bytes: int, *, limit: int | None = None) -> str:
    """The payload as compact JSON text, or ``InvalidEvent`` naming where it is not plain JSON.

    The fast path lets the C encoder do the checking: it refuses NaN, cycles and foreign
    types itself, a lone surrogate fails the UTF-8 encoding the size check needs anyway, and a
    NUL can only show up in the text as an escape. What the encoder would let through silently
    (non-string keys, which it turns into strings, and nesting past ``_MAX_DEPTH``) is checked by
    ``_plain_shape`` first. Anything suspicious goes to ``_check_json``, the precise walk that
    names the bad part.
    """
    if not _plain_shape(payload, 0):
        _check_json(payload, "payload", 0, set())
    try:
        text = _dumps(payload)
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        _check_json(payload, "payload", 0, set())
        # The walk found nothing: what is left to fail is an int longer than Python's
        # int-to-str digit limit (sys.get_int_max_str_digits).
        raise InvalidEvent(f"payload cannot be encoded as JSON: {exc}") from None
    if "\\u0000" in text:  # a NUL escaped, or a literal backslash-u0000: the walk tells which
        _check_json(payload, "payload", 0, set())
    if size > max_bytes:
        if limit is None:
            raise InvalidEvent(f"payload is {size} bytes encoded; max_payload_bytes is {max_bytes}")
        raise InvalidEvent(
            f"payload is {size} bytes encoded and headers {limit - max_bytes}; max_payload_bytes "
            f"(payload and headers together) is {limit}"
        )
    return text


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _plain_shape(value: object, depth: int) -> bool:
    """True if ``value`` is built of exactly dict, list, tuple and JSON's scalar types (no
    subclasses), every object key is a ``str`` and nothing nests deeper than ``_MAX_DEPTH``
    (a cycle, too, ends as too deep). False sends the payload through the precise walk."""
    kind = type(value)
    if depth >= _MAX_DEPTH and (kind not in _SCALARS or depth > _MAX_DEPTH):
        return False  # a container this deep, whose items would be too deep: let the walk say
    if kind is dict:
        for name, item in value.items():  # type: ignore[attr-defined]
            if type(name) is not str:
                return False
            if type(item) not in _SCALARS and not _plain_shape(item, depth + 1):
                return False
    elif kind is list or kind is tuple:
        for item in value:  # type: ignore[attr-defined]
            if type(item) not in _SCALARS and not _plain_shape(item, depth + 1):
                return False
    elif kind not in _SCALARS:
        return False
    return True


def _check_json(value: object, path: str, depth: int, seen: set[int]) -> None:
    if depth > _MAX_DEPTH:
        raise InvalidEvent(f"payload nests deeper than {_MAX_DEPTH} levels at {path}")
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, str):
        _check_string(path, value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidEvent(f"{path} is {value!r}; JSON has no NaN or Infinity")
    elif isinstance(value, dict | list | tuple):
        if id(value) in seen:
            raise InvalidEvent(f"{path} refers back to itself (a cycle); JSON cannot hold it")
        seen.add(id(value))
        if isinstance(value, dict):
            for name, item in value.items():
                if not isinstance(name, str):
                    raise InvalidEvent(
                        f"{path} has a key {name!r} of type {type(name).__name__}; "
                        "JSON object keys must be strings"
                    )
                _check_string(f"{path} key {name!r}", name)
                _check_json(item, f"{path}[{name!r}]", depth + 1, seen)
        else:
            for index, item in enumerate(value):
                _check_json(item, f"{path}[{index}]", depth + 1, seen)
        seen.discard(id(value))
    else:
        raise InvalidEvent(
            f"{path} is a {type(value).__name__}, which is not JSON "
            "(use str, int, float, bool, None, list or dict)"
        )
