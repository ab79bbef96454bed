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
from datetime import datetime

from ...core.model import DeadLetter, Event, Stats, UndecodablePayload
from ...core.text import printable, printable_json
from .dashboard import HandlerFailures, Sample

__all__ = ["event_page", "message_page", "overview", "text"]

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
        f"<input type='password' name='token' placeholder='token' autocomplete='off' required>"
        f" <button type='submit' name='action' value='{action}'>{label}</button></form>"
    )


def overview(
    *,
    store: str,
    stats: Stats,
    now: datetime,
    samples: Sequence[Sample],
    due: Sequence[Event],
    dead: Sequence[DeadLetter],
    failures: Sequence[HandlerFailures],
    scanned: int,
    scan_limit: int,
) -> str:
    """The front page."""
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
            str(e.id),
            text(e.topic),
            _when(e.available_at),
            str(e.attempts),
            f"<span class='err'>{text(e.last_error or '')}</span>",
        ]
        for e in due
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
    failure_rows = [
        [text(f.handler), str(f.dead), str(f.retrying), str(f.events), f"{f.rate:.0%}"]
        for f in failures
    ]
    scope = (
        f"among the {scanned} events with the lowest ids (at most {scan_limit} are read)"
        if scanned >= scan_limit
        else f"among all {scanned} events"
    )
    body = [
        "<h1>outboxkit</h1>",
        f"<p class='muted'>{text(store)} &middot; {_when(now)}</p>",
        f"<div class='counters'>{counters}</div>",
        f"<p>Oldest due: <span id='oldest-due'>{oldest}</span></p>",
        "<h2>Backlog over time</h2>",
        _sparkline(samples),
        f"<h2>Oldest due events</h2><p class='muted'>{scope}</p>",
        _table(["ID", "TOPIC", "DUE SINCE", "ATTEMPTS", "LAST ERROR"], due_rows, {0, 3})
        if due_rows
        else "<p>None: nothing is due.</p>",
        f"<h2>Dead letters</h2><p class='muted'>{len(dead)} shown, oldest failure first</p>",
        "<div id='dead-letters'>"
        + (
            _table(["ID", "TOPIC", "ATTEMPTS", "FAILED AT", "LAST ERROR"], dead_rows, {0, 2})
            if dead_rows
            else "<p>No dead letters.</p>"
        )
        + "</div>",
        f"<h2>Failures by handler</h2><p class='muted'>Events whose last error names the "
        f"handler, of the topics it failed on, {scope}</p>",
        _table(["HANDLER", "DEAD", "RETRYING", "EVENTS", "RATE"], failure_rows, {1, 2, 3, 4})
        if failure_rows
        else "<p>No handler is failing.</p>",
    ]
    return _page("outboxkit", "".join(body))


def event_page(event: Event, letter: DeadLetter | None) -> str:
    """One event; for a dead letter, its delivery records and the requeue and purge forms."""
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
    body = [
        "<p><a href='/'>&larr; overview</a></p>",
        f"<h1>Event {event.id}</h1>",
        _table(["", ""], rows, set()),
        f"<h2>Payload</h2><pre>{html.escape(printable_json(payload))}</pre>",
    ]
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
        body += [
            "<h2>Delivery records</h2>",
            _table(["HANDLER", "OUTCOME", "ATTEMPT", "AT", "REASON"], records, {2})
            if records
            else "<p>No handler recorded an outcome.</p>",
            "<h2>Actions</h2><p class='muted'>Requeue: due now, attempts reset; handlers with a "
            "record are not run again. Purge: deleted with its records, for good.</p>",
            _action(event.id, "requeue", "Requeue"),
            _action(event.id, "purge", "Purge"),
        ]
    return _page(f"outboxkit: event {event.id}", "".join(body))


def message_page(title: str, message: str) -> str:
    """A short page saying what happened (an action's result, or why it was refused)."""
    return _page(
        f"outboxkit: {title}",
        f"<p><a href='/'>&larr; overview</a></p><h1>{html.escape(title)}</h1>"
        f"<p id='message'>{html.escape(message)}</p>",
    )
