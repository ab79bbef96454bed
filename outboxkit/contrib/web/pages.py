"""The dashboard's HTML, rendered on the server: no script, no framework.

Every value that comes from the database (topics, keys, headers, payloads, error texts,
rejection reasons, handler names) goes through :func:`text`: its control characters shown as
escapes (``\\x1b``), as everywhere outboxkit prints stored text, then ``html.escape``, so
markup in an event is shown as the text it is. Numbers and instants are formatted here.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from urllib.parse import parse_qsl, urlencode

from ...core.model import AttemptError, DeadKey, DeadLetter, Event, Stats, UndecodablePayload
from ...core.text import printable, printable_json
from ...reading import DeadEventKey
from .dashboard import EventFilter, Sample, Survey

__all__ = [
    "dead_page",
    "event_page",
    "events_page",
    "filter_query",
    "login_page",
    "message_page",
    "overview",
    "preview_page",
    "text",
]

_PAYLOAD_SHOWN = 64 * 1024  # characters of a payload an event's page shows

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #ddd; vertical-align: top; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
.counters { display: flex; gap: 1em; flex-wrap: wrap; }
.counter { border: 1px solid #ccc; border-radius: 6px; padding: 8px 14px; min-width: 7em; }
.counter b { display: block; font-size: 1.5em; }
.dead b { color: #b00; } pre { background: #f6f6f6; padding: 8px; overflow-x: auto; }
.err { color: #b00; white-space: pre-wrap; word-break: break-word; }
form { display: inline-block; margin-right: 1em; } .muted { color: #777; }
nav { margin-bottom: 1em; } .flash { background: #eef6ee; padding: 6px 10px; }
"""


def text(value: object) -> str:
    """A stored value as HTML text: control characters escaped, then markup escaped."""
    return html.escape(printable("" if value is None else value))


def _when(at: datetime | None) -> str:
    return "-" if at is None else html.escape(at.isoformat(timespec="seconds"))


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _page(title: str, body: str) -> str:
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: set[int]) -> str:
    head = "".join(
        f"<th class='n'>{h}</th>" if i in numeric else f"<th>{h}</th>"
        for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(
            f"<td class='n'>{c}</td>" if i in numeric else f"<td>{c}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _sparkline(samples: Sequence[Sample], width: int = 600, height: int = 60) -> str:
    """Pending (blue) and dead (red) over the samples, as an inline SVG."""
    if len(samples) < 2:
        return "<p class='muted'>The backlog chart fills in as samples are taken.</p>"
    top = max(max(s.pending for s in samples), max(s.dead for s in samples), 1)
    step = width / (len(samples) - 1)

    def line(values: list[int], colour: str) -> str:
        points = " ".join(
            f"{i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}"
            for i, v in enumerate(values)
        )
        return f"<polyline fill='none' stroke='{colour}' stroke-width='2' points='{points}'/>"

    first, last = samples[0].at, samples[-1].at
    return (
        f"<svg id='backlog' width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
        "role='img' aria-label='pending and dead events over time'>"
        f"<rect width='{width}' height='{height}' fill='#fafafa' stroke='#ddd'/>"
        f"{line([s.pending for s in samples], '#2463eb')}{line([s.dead for s in samples], '#c00')}"
        "</svg>"
        f"<p class='muted'>Pending (blue) and dead (red), {len(samples)} samples from "
        f"{_when(first)} to {_when(last)}; highest {top}.</p>"
    )


def _action(event_id: int, action: str, label: str) -> str:
    return (
        f"<form method='post' action='/events/{event_id}/{action}'>"
        f"<button type='submit' name='action' value='{action}'>{label}</button></form>"
    )


def _header(signed_in: bool, message: str = "", *, refresh: bool = False) -> str:
    """The navigation, the sign-in state, and what the last action did."""
    account = (
        "<form method='post' action='/logout'><button id='sign-out'>Sign out</button></form>"
        if signed_in
        else "<a id='sign-in' href='/login'>Sign in</a> to act"
    )
    paused = (
        " &middot; <a href='/?refresh=off'>pause refresh</a>"
        if refresh
        else " &middot; <a href='/'>refresh every 10 s</a>"
    )
    shown = f"<p id='message' class='flash'>{html.escape(message)}</p>" if message else ""
    return (
        "<nav><a href='/'>Overview</a> &middot; <a href='/events'>Events</a> &middot; "
        f"<a href='/dead'>Dead letters</a>{paused} &middot; {account}</nav>{shown}"
    )


def filter_query(wanted: EventFilter, **extra: str) -> str:
    """A list's filter as a query string (values URL-encoded)."""
    fields = {
        "state": wanted.state,
        "topic": wanted.topic,
        "key": wanted.key,
        "error": wanted.error,
        "older_than": _age_text(wanted.older_than),
        **extra,
    }
    return urlencode({k: v for k, v in fields.items() if v})


def _age_text(age: timedelta | None) -> str:
    if age is None:
        return ""
    seconds = int(age.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0 and seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _filter_form(action: str, wanted: EventFilter, *, states: bool) -> str:
    def field(name: str, value: str, label: str) -> str:
        return (
            f"<label>{label} <input name='{name}' value='{html.escape(value)}' size='14'></label> "
        )

    choices = "".join(
        f"<option value='{s}'{' selected' if s == wanted.state else ''}>{s or 'any'}</option>"
        for s in EventFilter.STATES
    )
    state = f"<label>state <select name='state'>{choices}</select></label> " if states else ""
    return (
        f"<form id='filters' method='get' action='{action}'>{state}"
        + field("topic", wanted.topic, "topic")
        + field("key", wanted.key, "key")
        + field("error", wanted.error, "error text")
        + field("older_than", _age_text(wanted.older_than), "older than")
        + "<button type='submit'>Filter</button></form>"
    )


def overview(
    *,
    store: str,
    stats: Stats,
    now: datetime,
    samples: Sequence[Sample],
    survey: Survey,
    dead: Sequence[DeadLetter],
    held: Sequence[DeadEventKey],
    policy: DeadKey | None,
    signed_in: bool,
    refresh: bool,
    message: str = "",
) -> str:
    """The front page (it reloads itself every 10 s unless paused)."""
    counters = "".join(
        f"<div class='counter {cls}'>{label}<b id='count-{cls}'>{value}</b></div>"
        for label, cls, value in (
            ("pending", "pending", stats.pending),
            ("in flight", "in-flight", stats.claimed),
            ("published", "published", stats.published),
            ("dead", "dead", stats.dead),
        )
    )
    if stats.oldest_due_at is None:
        oldest = "nothing is waiting"
    else:
        waited = max(0.0, (now - stats.oldest_due_at).total_seconds())
        oldest = f"{_age(waited)} ({_when(stats.oldest_due_at)})"
    due_rows = [
        [
            f"<a href='/events/{e.id}'>{e.id}</a>",
            text(e.topic),
            _when(e.available_at),
            str(e.attempts),
            f"<span class='err'>{text(e.last_error or '')}</span>",
        ]
        for e in survey.due
    ]
    dead_rows = [
        [
            f"<a href='/events/{d.event.id}'>{d.event.id}</a>",
            f"<span class='topic'>{text(d.event.topic)}</span>",
            str(d.event.attempts),
            _when(d.failed_at),
            f"<span class='err'>{text(d.last_error or '')}</span>",
        ]
        for d in dead
    ]
    held_rows = [
        [
            f"<span class='key'>{text(k.key)}</span>",
            f"<a href='/events/{k.dead.event.id}'>{k.dead.event.id}</a>",
            text(k.dead.event.topic),
            _when(k.dead.failed_at),
        ]
        for k in held
    ]
    failure_rows = [
        [text(f.handler), str(f.dead), str(f.retrying), str(f.events), f"{f.rate:.0%}"]
        for f in survey.failures
    ]
    scope = f"{survey.scanned} events by id after id {survey.first_id}"
    if survey.first_id:
        scope += " (those below were all published when last read)"
    if not survey.complete:
        scope += (
            f" (the most one page reads); <a id='survey-more' href='/events?state=due&after="
            f"{survey.last_id}'>go on after id {survey.last_id}</a>"
        )
    held_title = {
        "hold": "Held keys (dead_key='hold': their later events wait)",
        "release": "Keys with a dead event (dead_key='release': not held)",
        None: "Keys with a dead event (held only if the app's dead_key is 'hold')",
    }[policy]
    body = [
        "<meta http-equiv='refresh' content='10'>" if refresh else "",
        _header(signed_in, message, refresh=refresh),
        "<h1>outboxkit</h1>",
        f"<p class='muted'>{text(store)} &middot; {_when(now)}</p>",
        f"<div class='counters'>{counters}</div>",
        f"<p>Oldest due: <span id='oldest-due'>{oldest}</span></p>",
        "<h2>Backlog over time</h2>",
        _sparkline(samples),
        f"<h2>Oldest due events</h2><p class='muted'>Among {scope}; "
        "<a href='/events?state=due'>every due event</a></p>",
        "<div id='oldest-due-events'>"
        + (
            _table(["ID", "TOPIC", "DUE SINCE", "ATTEMPTS", "LAST ERROR"], due_rows, {0, 3})
            if due_rows
            else "<p>None found: nothing is due there.</p>"
        )
        + "</div>",
        f"<h2>{held_title}</h2><div id='held-keys'>"
        + (
            _table(["KEY", "DEAD EVENT", "TOPIC", "FAILED AT"], held_rows, {1})
            if held_rows
            else "<p>No key has a dead event.</p>"
        )
        + f"</div><p class='muted'>{stats.dead_keys} key(s) with a dead event in all</p>",
        "<h2>Dead letters</h2><p class='muted'>The first 10, oldest failure first; "
        "<a href='/dead'>all, with filters and bulk actions</a></p>",
        "<div id='dead-letters'>"
        + (
            _table(["ID", "TOPIC", "ATTEMPTS", "FAILED AT", "LAST ERROR"], dead_rows, {0, 2})
            if dead_rows
            else "<p>No dead letters.</p>"
        )
        + "</div>",
        f"<h2>Failures by handler</h2><p class='muted'>Events whose last error names the "
        f"handler, of the topics it failed on, among {scope}</p>",
        _table(["HANDLER", "DEAD", "RETRYING", "EVENTS", "RATE"], failure_rows, {1, 2, 3, 4})
        if failure_rows
        else "<p>No handler is failing.</p>",
    ]
    return _page("outboxkit", "".join(body))


def events_page(
    wanted: EventFilter,
    rows: Sequence[Event],
    after: int,
    next_after: int | None,
    now: datetime,
    signed_in: bool,
) -> str:
    """Events matching a filter, a page at a time by id (keyset)."""
    table_rows = [
        [
            f"<a href='/events/{e.id}'>{e.id}</a>",
            f"<span class='topic'>{text(e.topic)}</span>",
            text(e.key) if e.key is not None else "-",
            html.escape(e.state.value),
            _when(e.created_at),
            str(e.attempts),
            f"<span class='err'>{text(e.last_error or '')}</span>",
        ]
        for e in rows
    ]
    more = (
        f"<a id='next' href='/events?{filter_query(wanted, after=str(next_after))}'>"
        f"Next page (after id {next_after})</a>"
        if next_after is not None
        else "<p id='end' class='muted'>No more events.</p>"
    )
    body = [
        _header(signed_in),
        "<h1>Events</h1>",
        _filter_form("/events", wanted, states=True),
        f"<p class='muted'>After id {after}, by id</p>",
        "<div id='events'>"
        + (
            _table(
                ["ID", "TOPIC", "KEY", "STATE", "CREATED", "ATTEMPTS", "LAST ERROR"],
                table_rows,
                {0, 5},
            )
            if table_rows
            else "<p>No event here matches.</p>"
        )
        + "</div>",
        more,
    ]
    return _page("outboxkit: events", "".join(body))


def dead_page(
    wanted: EventFilter,
    rows: Sequence[DeadLetter],
    cursor: tuple[datetime, int] | None,
    signed_in: bool,
    message: str = "",
) -> str:
    """Dead letters matching a filter, oldest failure first, a page at a time, and the bulk
    actions (each through a preview)."""
    table_rows = [
        [
            f"<a href='/events/{d.event.id}'>{d.event.id}</a>",
            f"<span class='topic'>{text(d.event.topic)}</span>",
            text(d.event.key) if d.event.key is not None else "-",
            str(d.event.attempts),
            _when(d.failed_at),
            f"<span class='err'>{text(d.last_error or '')}</span>",
        ]
        for d in rows
    ]
    more = "<p id='end' class='muted'>No more dead letters.</p>"
    if cursor is not None:
        at, event_id = cursor
        query = filter_query(wanted, after_at=at.isoformat(), after_id=str(event_id))
        more = f"<a id='next' href='/dead?{query}'>Next page</a>"
    bulk = "".join(
        "<form method='get' action='/dead/preview'>"
        + "".join(
            f"<input type='hidden' name='{k}' value='{html.escape(v)}'>"
            for k, v in parse_qsl(filter_query(wanted))
        )
        + f"<button id='bulk-{action}' name='action' value='{action}'>{label} every match…"
        "</button></form>"
        for action, label in (("requeue", "Requeue"), ("purge", "Purge"))
    )
    body = [
        _header(signed_in, message),
        "<h1>Dead letters</h1>",
        _filter_form("/dead", wanted, states=False),
        "<div id='dead-letters'>"
        + (
            _table(
                ["ID", "TOPIC", "KEY", "ATTEMPTS", "FAILED AT", "LAST ERROR"], table_rows, {0, 3}
            )
            if table_rows
            else "<p>No dead letter matches.</p>"
        )
        + "</div>",
        more,
        "<h2>Bulk</h2><p class='muted'>Every dead letter the filter matches: a preview first "
        "says how many and which.</p>",
        bulk,
    ]
    return _page("outboxkit: dead letters", "".join(body))


def preview_page(
    wanted: EventFilter,
    action: str,
    as_of: datetime,
    ids: Sequence[int],
    more: bool,
    limit: int,
    signed_in: bool,
) -> str:
    """What a bulk action would change, and the form that does it."""
    verb = "requeue" if action == "requeue" else "delete for good"
    count = f"{len(ids)}{'+' if more else ''}"
    first = ", ".join(f"<a href='/events/{i}'>{i}</a>" for i in ids[:20])
    hidden = "".join(
        f"<input type='hidden' name='{k}' value='{html.escape(v)}'>"
        for k, v in parse_qsl(filter_query(wanted, action=action, as_of=as_of.isoformat()))
    )
    confirm = (
        f"<form method='post' action='/dead/bulk'>{hidden}"
        f"<button id='confirm'>{html.escape(verb.capitalize())} {len(ids)} dead letter(s)</button>"
        "</form>"
        if signed_in and ids
        else (
            "<p>Nothing matches.</p>" if not ids else "<p><a href='/login'>Sign in</a> to act.</p>"
        )
    )
    body = [
        _header(signed_in),
        f"<h1>Preview: {html.escape(action)}</h1>",
        f"<p id='preview'>Would {verb} <b id='preview-count'>{count}</b> dead letter(s) "
        f"(dead at {_when(as_of)}; one that dies again since is left alone)"
        + (f"; at most {limit} per action" if more else "")
        + "</p>",
        f"<p class='muted'>First ids: <span id='preview-ids'>{first or '-'}</span></p>",
        confirm,
        f"<p><a href='/dead?{filter_query(wanted)}'>Back</a></p>",
    ]
    return _page("outboxkit: preview", "".join(body))


def login_page(signed_in: bool) -> str:
    """The sign-in form: the token once, for a session (a cookie)."""
    form = (
        "<p>Signed in.</p>"
        if signed_in
        else "<form method='post' action='/login'><label>Token <input type='password' "
        "name='token' autocomplete='current-password' required></label> "
        "<button id='sign-in-button'>Sign in</button></form>"
    )
    return _page("outboxkit: sign in", _header(signed_in) + "<h1>Sign in</h1>" + form)


def event_page(
    event: Event,
    letter: DeadLetter | None,
    signed_in: bool = False,
    message: str = "",
    errors: Sequence[AttemptError] | None = None,
) -> str:
    """One event, the error of each failed attempt (``errors``; None: the store keeps only
    the last); for a dead letter, its delivery records and the requeue and purge forms."""
    payload = event.payload.raw if isinstance(event.payload, UndecodablePayload) else event.payload
    state = event.state.value
    rows = [
        ["topic", f"<span class='topic'>{text(event.topic)}</span>"],
        ["state", f"<b id='state'>{html.escape(state)}</b>"],
        ["attempts", str(event.attempts)],
        ["created", _when(event.created_at)],
        ["due", _when(event.available_at)],
        ["published", _when(event.published_at)],
        ["failed", _when(event.failed_at)],
        ["key", text(event.key) if event.key is not None else "-"],
        ["headers", text(json.dumps(dict(event.headers), ensure_ascii=False))],
        ["last error", f"<span class='err' id='last-error'>{text(event.last_error or '-')}</span>"],
    ]
    shown = printable_json(payload)
    if len(shown) > _PAYLOAD_SHOWN:
        shown = shown[:_PAYLOAD_SHOWN] + f"\n… ({len(shown) - _PAYLOAD_SHOWN} more characters)"
    body = [
        _header(signed_in, message),
        f"<h1>Event {event.id}</h1>",
        _table(["", ""], rows, set()),
        f"<h2>Payload</h2><pre>{html.escape(shown)}</pre>",
        "<h2>Errors by attempt</h2>",
    ]
    if errors is None:
        body.append("<p class='muted'>This store keeps the last error only (above).</p>")
    elif not errors:
        body.append("<p id='attempt-errors'>No attempt failed.</p>")
    else:
        attempts = [
            [str(e.attempt), _when(e.at), f"<span class='err'>{text(e.error)}</span>"]
            for e in errors
        ]
        table = _table(["ATTEMPT", "AT", "ERROR"], attempts, {0})
        body.append(f"<div id='attempt-errors'>{table}</div>")
    if letter is not None:
        records = [
            [
                text(r.handler),
                html.escape(r.outcome.value),
                str(r.attempt),
                _when(r.recorded_at),
                text(r.reason or ""),
            ]
            for r in letter.records
        ]
        actions = (
            _action(event.id, "requeue", "Requeue") + _action(event.id, "purge", "Purge")
            if signed_in
            else "<p><a href='/login'>Sign in</a> to requeue or purge it.</p>"
        )
        body += [
            "<h2>Delivery records</h2>",
            _table(["HANDLER", "OUTCOME", "ATTEMPT", "AT", "REASON"], records, {2})
            if records
            else "<p>No handler recorded an outcome.</p>",
            "<h2>Actions</h2><p class='muted'>Requeue: due now, attempts reset; handlers with a "
            "record are not run again. Purge: deleted with its records, for good.</p>",
            actions,
        ]
    return _page(f"outboxkit: event {event.id}", "".join(body))


def message_page(title: str, message: str) -> str:
    """A short page saying what happened (an action's result, or why it was refused)."""
    return _page(
        f"outboxkit: {title}",
        f"<p><a href='/'>&larr; overview</a></p><h1>{html.escape(title)}</h1>"
        f"<p id='message'>{html.escape(message)}</p>",
    )
