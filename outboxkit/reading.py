"""Operators' reads in bounded pages: every dead letter, streamed, and the keys with a dead
event, each with the event that holds it.

``Outbox.dead_letters(limit=...)`` returns a list; a command listing 300,000 dead letters must
not hold them all. :func:`iter_dead_letters` pages through them with the store's own read
(``failed_at >= since``, oldest failure first), moving ``since`` to the last failure seen and
skipping the rows already given: memory holds one page (and, at most, the rows that share
one failure instant, which a batch settled in one transaction may).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from .core.duration import before
from .core.model import DeadLetter
from .errors import ConfigurationError

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = ["DEFAULT_PAGE_SIZE", "DeadEventKey", "dead_keys", "iter_dead_letters"]

DEFAULT_PAGE_SIZE = 200
MAX_LIMIT = 1_000_000  # as Outbox.dead_letters


@dataclass(frozen=True, slots=True)
class DeadEventKey:
    """A key with a dead event: the oldest one (by failure), which holds the key under
    ``dead_key="hold"`` until it is requeued or purged."""

    key: str
    dead: DeadLetter


def iter_dead_letters(
    outbox: Outbox,
    *,
    topic: str | None = None,
    since: datetime | timedelta | None = None,
    limit: int | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    after: tuple[datetime, int] | None = None,
) -> Iterator[DeadLetter]:
    """Dead letters, oldest failure first, read ``page_size`` at a time.

    Args:
        outbox: whose store to read.
        topic: only this topic.
        since: failed at or after this aware instant, or within this long before now (read
            once, at the start, by the store's clock).
        limit: at most this many; None: all.
        page_size: dead letters per read (1 to 10,000).
        after: start after this ``(failed_at, id)`` (a page's last, to page by keyset).

    Raises:
        ConfigurationError: a bad page size, limit, topic or ``since``.
        StoreError: the store failed.
    """
    if not isinstance(page_size, int) or not 1 <= page_size <= 10_000:
        raise ConfigurationError(f"page_size must be 1 to 10,000, got {page_size!r:.40}")
    if limit is not None and (
        not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT
    ):
        raise ConfigurationError(
            f"limit must be an integer from 1 to {MAX_LIMIT:,} or None, got {limit!r:.40}"
        )
    if isinstance(since, timedelta):
        since = before(outbox.now(), since)
    # Checked now, when called, not at the first next(): a command refuses before it prints.
    return _pages(outbox, topic, since, limit, page_size, after)


def _pages(
    outbox: Outbox,
    topic: str | None,
    since: datetime | None,
    limit: int | None,
    page_size: int,
    after: tuple[datetime, int] | None,
) -> Iterator[DeadLetter]:
    given = 0
    cursor: tuple[datetime, int] | None = after
    at_cursor = 0  # dead letters given that failed at the cursor's instant
    extra = 0  # more rows to read when a page held nothing new (rows sharing one instant)
    while limit is None or given < limit:
        want = page_size + at_cursor + extra
        page = outbox.dead_letters(
            topic=topic, since=since if cursor is None else cursor[0], limit=min(want, 1_000_000)
        )
        fresh = [d for d in page if cursor is None or (d.failed_at, d.event.id) > cursor]
        if not fresh:
            if len(page) < want:
                return
            extra = extra * 2 or page_size  # all seen: the instant holds more rows than read
            continue
        extra = 0
        for letter in fresh:
            if limit is not None and given >= limit:
                return
            yield letter
            given += 1
            if cursor is not None and letter.failed_at == cursor[0]:
                at_cursor += 1
            else:
                at_cursor = 1
            cursor = (letter.failed_at, letter.event.id)
        if len(page) < want:
            return


def dead_keys(
    outbox: Outbox, *, limit: int = 20, page_size: int = DEFAULT_PAGE_SIZE
) -> list[DeadEventKey]:
    """The first ``limit`` keys with a dead event (by their oldest failure), each with that
    event; read ``page_size`` dead letters at a time, stopping once ``limit`` keys are found.

    Raises:
        StoreError: the store failed.
    """
    found: dict[str, DeadEventKey] = {}
    for letter in iter_dead_letters(outbox, page_size=page_size):
        key = letter.event.key
        if key is not None and key not in found:
            found[key] = DeadEventKey(key, letter)
            if len(found) >= limit:
                break
    return list(found.values())
