"""Text that any store can keep and any terminal can show. PURE: strings in, strings out.

Two directions, one module:

- ``storable``: what outboxkit writes into a store that did not come through ``enqueue``'s
  validation - a handler's error text, a ``Reject`` reason - may hold characters no database
  keeps: a NUL (PostgreSQL text refuses it) or a lone surrogate (what ``os.fsdecode`` makes of an
  odd file name; it has no UTF-8 form). They are replaced *visibly* by their Python escapes
  (``\\x00``, ``\\udcff``), and the text is cut to a bounded length, so that storing it can never
  fail and reading it back always gives readable text.
- ``printable``: stored text shown on a terminal (``outboxkit dead list``, ``status``...) may
  hold control characters that a terminal obeys (clear the screen, set the window title, make a
  hyperlink, move the cursor, reorder text). Every C0 and C1 control character, DEL and the
  Unicode bidirectional controls are shown as escapes instead; ``printable_json`` does the same
  for JSON output.
- ``redact``: a store URL or connection string may carry a password; every message naming one
  goes through ``redact_url`` / ``scrub``.
- ``parse_decimal``: a number that came from outside (a URL's path, a header, an argument, the
  environment) read strictly: ASCII digits only, and bounded before it is converted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote, urlsplit

__all__ = [
    "MAX_ERROR_CHARS",
    "describe_exception",
    "parse_decimal",
    "printable",
    "printable_json",
    "redact_url",
    "scrub",
    "secrets_of",
    "storable",
]

MAX_ERROR_CHARS = 4000
"""The longest error text or rejection reason a store keeps (longer ones are cut, marked)."""

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_CUT = " ... [cut]"


def storable(text: object, *, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` as a string every store keeps: NUL and lone surrogates replaced by their Python
    escapes (``\\x00``, ``\\udcff``), at most ``limit`` characters (a longer text is cut and
    ends with ``... [cut]``)."""
    value = text if isinstance(text, str) else _str(text)
    if _UNSTORABLE.search(value) is not None:
        value = _UNSTORABLE.sub(_escape, value)
    if len(value) > limit:
        value = value[: max(0, limit - len(_CUT))] + _CUT
    return value


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: message"`` for an exception, storable (see ``storable``); an exception whose
    ``str()`` itself fails is described by its type alone."""
    message = _str(exc)
    return storable(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)


def _str(value: object) -> str:
    try:
        return str(value)
    except Exception as exc:  # a hostile __str__ must not take the poller down
        return f"<unprintable {type(value).__name__}: str() raised {type(exc).__name__}>"


# C0 controls, DEL, C1 controls (ESC, CSI, OSC ... in 7- and 8-bit form), the line and
# paragraph separators, and the bidirectional controls (text that displays in another order).
_OTHER_CONTROLS = "\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_UNPRINTABLE = re.compile(f"[\x00-\x1f{_OTHER_CONTROLS}\ud800-\udfff]")
_UNPRINTABLE_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f{_OTHER_CONTROLS}\ud800-\udfff]")
_UNPRINTABLE_IN_JSON = re.compile(f"[{_OTHER_CONTROLS}\ud800-\udfff]")


def printable(text: object, *, newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on shown as an escape: C0 and C1
    controls (``\\x1b`` ...), DEL, lone surrogates and the bidirectional controls. With
    ``newlines``, line breaks are kept (for multi-line output); else they are escaped too."""
    value = text if isinstance(text, str) else _str(text)
    pattern = _UNPRINTABLE_BUT_NEWLINE if newlines else _UNPRINTABLE
    if pattern.search(value) is None:
        return value
    return pattern.sub(_escape, value)


def printable_json(data: Any, *, indent: int | None = 2) -> str:
    """``data`` as JSON safe to print: non-ASCII text stays readable, but control characters
    (which JSON escapes only below U+0020), C1 controls and bidirectional controls are written
    as ``\\uXXXX`` escapes. They can only occur inside strings, where the escape is valid JSON."""
    text = json.dumps(data, indent=indent, ensure_ascii=False)
    if _UNPRINTABLE_IN_JSON.search(text) is None:
        return text
    return _UNPRINTABLE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


# -- numbers from outside ---------------------------------------------------------------------

_ASCII_DECIMAL = re.compile(r"[0-9]+")


def parse_decimal(text: object, *, minimum: int = 0, maximum: int) -> int | None:
    """``text`` read as a whole number from ``minimum`` to ``maximum``, or None.

    Only ASCII digits are taken: ``str.isdigit`` (and ``int``) also take other scripts' digits
    and superscripts (``"²"`` is a digit to ``isdigit`` and refused by ``int``), signs, blanks
    and underscores; none of those is a number here. The length is checked before ``int``
    reads it (``int`` refuses more than 4,300 digits with an error of its own).

    Args:
        text: the text as received.
        minimum: the smallest number taken (>= 0).
        maximum: the largest number taken.

    Returns:
        The number, or None when ``text`` is not such a number.
    """
    if not isinstance(text, str) or len(text) > len(str(maximum)):
        return None
    if _ASCII_DECIMAL.fullmatch(text) is None:
        return None
    number = int(text)
    return number if minimum <= number <= maximum else None


# -- secrets ----------------------------------------------------------------------------------

_CONNINFO_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_MIN_SECRET = 4  # shorter "secrets" would blot out ordinary words


def secrets_of(url: object) -> tuple[str, ...]:
    """The passwords a store URL or libpq conninfo string carries (as written and decoded),
    longest first: what ``scrub`` must keep out of any message."""
    if not isinstance(url, str):
        return ()
    found: set[str] = set()
    if "://" in url:
        try:
            password = urlsplit(url).password
        except ValueError:
            password = None
        if password:
            found.update({password, unquote(password), quote(unquote(password), safe="")})
    for match in _CONNINFO_PASSWORD.finditer(url):
        value = match.group(2)
        found.update({value, value.strip("'")})
    return tuple(sorted((s for s in found if len(s) >= _MIN_SECRET), key=len, reverse=True))


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every one of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def redact_url(url: object) -> str:
    """A store URL or conninfo string fit for a message: its password replaced by ``***``."""
    if not isinstance(url, str):
        return repr(url)
    text = _CONNINFO_PASSWORD.sub(lambda m: m.group(1) + "***", url)
    if "://" in text:
        try:
            parts = urlsplit(text)
            password = parts.password
        except ValueError:
            return scrub(text, secrets_of(url))
        if password is not None:
            user = parts.username or ""
            host = parts.netloc.rpartition("@")[2]
            text = parts._replace(netloc=f"{user}:***@{host}").geturl()
    return scrub(text, secrets_of(url))
