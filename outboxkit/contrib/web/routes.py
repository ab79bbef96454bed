"""The dashboard's pages and actions from a request's query or form: what to read, parsed and
checked here (a bad value is ``BadQuery``, a 400 naming it), the page rendered by ``pages``.

Lists page by keyset (``after`` an id, or a dead letter's ``(failed_at, id)``), never by
offset, so every event can be reached however many there are.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from ...core.text import parse_decimal
from ...outbox import MAX_EVENT_ID
from . import pages
from .dashboard import BULK_LIMIT, Dashboard, EventFilter

__all__ = ["BadQuery", "bulk", "dead", "events", "flash", "one", "overview", "preview"]

Query = dict[str, list[str]]

_AGE = re.compile(r"^\s*(\d{1,6})\s*(s|m|h|d)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DONE = {"requeued", "purged", "signed-in", "signed-out"}


class BadQuery(ValueError):
    """A parameter that is no valid value (the message names it)."""


def _one(query: Query, name: str) -> str:
    values = query.get(name) or [""]
    value = values[0]
    if len(value) > 500:
        raise BadQuery(f"{name} is too long (at most 500 characters)")
    return value


def _id(query: Query, name: str) -> int:
    text = _one(query, name)
    if not text:
        return 0
    value = parse_decimal(text, minimum=0, maximum=MAX_EVENT_ID)
    if value is None:
        raise BadQuery(f"{name} must be an event id (0 to {MAX_EVENT_ID})")
    return value


def event_filter(query: Query) -> EventFilter:
    """The filter a list's query gives: ``state``, ``topic``, ``key``, ``error`` (text in the
    last error), ``older_than`` (``30s``, ``15m``, ``2h``, ``7d``)."""
    state = _one(query, "state")
    if state not in EventFilter.STATES:
        raise BadQuery(f"state must be one of {', '.join(s for s in EventFilter.STATES if s)}")
    age = _one(query, "older_than")
    older_than = None
    if age:
        found = _AGE.match(age)
        if found is None:
            raise BadQuery("older_than must be a number and a unit: 30s, 15m, 2h or 7d")
        older_than = timedelta(seconds=int(found.group(1)) * _UNITS[found.group(2)])
    return EventFilter(
        state=state,
        topic=_one(query, "topic"),
        key=_one(query, "key"),
        error=_one(query, "error"),
        older_than=older_than,
    )


def flash(query: Query) -> str:
    """What the last action did, from the redirect's ``done`` and ``n`` (known words and a
    number only: nothing of the query is shown as it is)."""
    done = _one(query, "done")
    if done not in _DONE:
        return ""
    if done.startswith("signed"):
        return done.replace("-", " ")
    count = parse_decimal(_one(query, "n"), minimum=0, maximum=10**9) or 0
    return f"{done} {count} dead letter(s)"


def overview(dashboard: Dashboard, query: Query, signed_in: bool, message: str) -> str:
    outbox = dashboard.outbox
    stats = outbox.stats()
    now = outbox.now()
    survey = dashboard.survey(now)
    dead, _ = dashboard.dead_page(EventFilter(), None)
    return pages.overview(
        store=dashboard.name,
        stats=stats,
        now=now,
        samples=dashboard.samples,
        survey=survey,
        dead=dead[:10],
        held=dashboard.held_keys() if stats.dead_keys else [],
        policy=dashboard.policy,
        signed_in=signed_in,
        refresh=_one(query, "refresh") != "off",
        message=message,
    )


def events(dashboard: Dashboard, query: Query, signed_in: bool) -> str:
    wanted = event_filter(query)
    after = _id(query, "after")
    now = dashboard.outbox.now()
    rows, last, more = dashboard.page(wanted, now, after)
    return pages.events_page(wanted, rows, after, last if more else None, now, signed_in)


def _cursor(query: Query) -> tuple[datetime, int] | None:
    at, event_id = _one(query, "after_at"), _id(query, "after_id")
    if not at:
        return None
    try:
        instant = datetime.fromisoformat(at)
    except ValueError:
        raise BadQuery("after_at must be an ISO 8601 instant") from None
    if instant.tzinfo is None:
        raise BadQuery("after_at must have a UTC offset")
    return instant, event_id


def dead(dashboard: Dashboard, query: Query, signed_in: bool, message: str) -> str:
    wanted = event_filter(query)
    rows, cursor = dashboard.dead_page(wanted, _cursor(query))
    return pages.dead_page(wanted, rows, cursor, signed_in, message)


def _action(query: Query) -> str:
    action = _one(query, "action")
    if action not in ("requeue", "purge"):
        raise BadQuery("action must be requeue or purge")
    return action


def preview(dashboard: Dashboard, query: Query, signed_in: bool) -> str:
    """What a bulk action would change, as of now (the store's clock): the count, the first
    ids, and the form that does it for the dead letters of that instant."""
    wanted = event_filter(query)
    action = _action(query)
    as_of = dashboard.outbox.now()
    ids, more = dashboard.matching_dead(wanted, as_of)
    return pages.preview_page(wanted, action, as_of, ids, more, BULK_LIMIT, signed_in)


def bulk(dashboard: Dashboard, form: Query) -> tuple[str, list[int], str]:
    """The bulk action a preview's form posts: the dead letters the filter matches that failed
    at or before the preview's instant (one that dies again since is left alone)."""
    action = _action(form)
    wanted = event_filter(form)
    as_of_text = _one(form, "as_of")
    try:
        as_of = datetime.fromisoformat(as_of_text)
    except ValueError:
        raise BadQuery("as_of must be an ISO 8601 instant") from None
    if as_of.tzinfo is None:
        raise BadQuery("as_of must have a UTC offset")
    ids, _ = dashboard.matching_dead(wanted, as_of)
    return action, ids, "/dead?" + pages.filter_query(wanted)


def one(dashboard: Dashboard, path: str) -> tuple[str, list[int], str]:
    """``/events/ID/requeue`` or ``/events/ID/purge``."""
    parts = path.strip("/").split("/")
    if len(parts) != 3 or parts[0] != "events" or parts[2] not in ("requeue", "purge"):
        raise BadQuery("no such action")
    event_id = parse_decimal(parts[1], minimum=1, maximum=MAX_EVENT_ID)
    if event_id is None:
        raise BadQuery(f"not an event id (ids are numbers from 1 to {MAX_EVENT_ID})")
    return parts[2], [event_id], f"/events/{event_id}"
