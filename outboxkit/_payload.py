"""Validation of events before any SQL runs (R1).

PURE: no I/O. Every check here runs before a store sees the event, so a bad event raises
``InvalidEvent`` and the caller's transaction is untouched.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ._model import NewEvent, UndecodablePayload
from .errors import InvalidEvent

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
) -> NewEvent:
    """Validate one event and serialise its payload.

    Raises:
        InvalidEvent: naming the bad part - a topic that is not a short non-empty string,
            a payload that is not plain JSON (NaN/Infinity, NUL characters, lone surrogates,
            non-JSON types, cycles) or is larger than ``max_payload_bytes``, headers that are not
            a str->str mapping, a key that is not a string, a negative or non-finite delay.
    """
    _check_text("topic", topic, MAX_TOPIC_LENGTH, allow_empty=False)
    assert isinstance(topic, str)
    if key is not None:
        _check_text("key", key, MAX_KEY_LENGTH, allow_empty=False)
        assert isinstance(key, str)
    return NewEvent(
        topic=topic,
        payload_json=_encode_payload(payload, max_payload_bytes),
        headers=_check_headers(headers),
        key=key,
        delay=_check_delay(delay),
    )


def decode_payload(text: str | bytes) -> Any:
    """Parse a stored payload; one that is not JSON (written behind outboxkit's back) comes back
    as an ``UndecodablePayload`` carrying the error, so the event can be dead-lettered."""
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
        return UndecodablePayload(raw=raw, error=f"stored payload is not valid JSON: {exc}")


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


def _check_delay(delay: object) -> timedelta:
    if delay is None:
        return timedelta(0)
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise InvalidEvent(f"delay must be seconds or a timedelta, got {type(delay).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidEvent(f"delay must be a finite, non-negative duration, got {delay!r}")
    if seconds > MAX_DELAY.total_seconds():
        raise InvalidEvent(f"delay {delay!r} is longer than the limit of {MAX_DELAY.days} days")
    return delay if isinstance(delay, timedelta) else timedelta(seconds=seconds)


def _encode_payload(payload: object, max_bytes: int) -> str:
    _check_json(payload, "payload", 0, set())
    # The walk above already refused NaN, cycles and foreign types; what is left to fail is an
    # int longer than Python's int-to-str digit limit (sys.get_int_max_str_digits).
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError as exc:
        raise InvalidEvent(f"payload cannot be encoded as JSON: {exc}") from None
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise InvalidEvent(f"payload is {size} bytes encoded; max_payload_bytes is {max_bytes}")
    return text


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
