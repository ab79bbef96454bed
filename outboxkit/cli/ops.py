"""The ops commands: ``migrate``, ``status``, ``dead list|show|requeue|purge``, ``purge``.

Each opens the outbox it works on (``stores.open_outbox``) and calls the same ``Outbox`` method
an app calls in Python; what it prints goes through ``output.echo``. None but ``migrate``
creates or migrates a database.

The destructive ones (``purge``, ``dead purge``, ``dead requeue --all``) take ``--dry-run``
(count what would be touched, change nothing) and ``--yes``: without it they ask on a terminal,
showing the count, and refuse elsewhere (a script must say ``--yes``), before opening the store.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

import click

from ..core.model import DeadKey, DeadLetter, DeliveryRecord, Event, Stats, UndecodablePayload
from ..core.text import printable_json
from ..outbox import Outbox
from ..reading import DEFAULT_PAGE_SIZE, DeadEventKey, dead_keys, iter_dead_letters
from .errors import InputError
from .output import age, clip, echo, one_line, print_json, table
from .params import DURATION, EVENT_ID, Since, Whole, format_duration
from .stores import open_outbox, with_store_options

__all__ = ["dead", "migrate", "purge", "status"]


# -- JSON shapes --------------------------------------------------------------------------------


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


def _record_json(record: DeliveryRecord) -> dict[str, Any]:
    return {
        "handler": record.handler,
        "outcome": record.outcome.value,
        "attempt": record.attempt,
        "recorded_at": _iso(record.recorded_at),
        "reason": record.reason,
    }


def _event_json(event: Event) -> dict[str, Any]:
    return {
        "id": event.id,
        "topic": event.topic,
        "payload": (
            event.payload.raw if isinstance(event.payload, UndecodablePayload) else event.payload
        ),
        "headers": dict(event.headers),
        "key": event.key,
        "attempts": event.attempts,
        "created_at": _iso(event.created_at),
        "failed_at": _iso(event.failed_at),
        "last_error": event.last_error,
    }


def _dead_json(dead: DeadLetter) -> dict[str, Any]:
    return {**_event_json(dead.event), "records": [_record_json(r) for r in dead.records]}


def _dead_key_json(entry: DeadEventKey) -> dict[str, Any]:
    event = entry.dead.event
    return {
        "key": entry.key,
        "event_id": event.id,
        "topic": event.topic,
        "failed_at": _iso(entry.dead.failed_at),
    }


def _status_json(
    outbox: Outbox, stats: Stats, now: datetime, policy: DeadKey | None, keys: list[DeadEventKey]
) -> dict[str, Any]:
    oldest_age = (
        None if stats.oldest_due_at is None else (now - stats.oldest_due_at).total_seconds()
    )
    return {
        "store": repr(outbox.store),
        "now": _iso(now),
        "pending": stats.pending,
        "in_flight": stats.claimed,
        "published": stats.published,
        "dead": stats.dead,
        "total": stats.total,
        "oldest_due_at": _iso(stats.oldest_due_at),
        "oldest_due_age_seconds": oldest_age,
        "dead_key": policy,
        "dead_keys": stats.dead_keys,
        "held_keys": None if policy is None else stats.held_keys,
        "keys_with_a_dead_event": [_dead_key_json(entry) for entry in keys],
        "by_topic": {
            topic: {
                "pending": counts.get("pending", 0),
                "in_flight": counts.get("claimed", 0),
                "published": counts.get("published", 0),
                "dead": counts.get("dead", 0),
            }
            for topic, counts in sorted(stats.by_topic.items())
        },
    }


# -- migrate, status ----------------------------------------------------------------------------


F = TypeVar("F", bound=Callable[..., Any])


def destructive(fn: F) -> F:
    """``--dry-run`` and ``--yes``, for the commands that delete or requeue in bulk."""
    fn = click.option(
        "--yes", "-y", "yes", is_flag=True, help="Do it without asking (needed off a terminal)."
    )(fn)
    fn = click.option(
        "--dry-run", "dry_run", is_flag=True, help="Count what would be touched; change nothing."
    )(fn)
    return fn


def _refuse_without_terminal(command: str, *, yes: bool, dry_run: bool) -> None:
    """Off a terminal, a destructive command runs only with ``--yes`` (or as a dry run)."""
    if yes or dry_run or sys.stdin.isatty():
        return
    raise InputError(
        f"`outboxkit {command}` changes data and there is no terminal to confirm on: "
        "pass --yes to do it (or --dry-run to count what it would touch)"
    )


def _confirmed(question: str, count: int, *, yes: bool) -> bool:
    """Whether to go on: ``--yes``, nothing to do, or the operator said yes on the terminal."""
    if yes or count == 0:
        return True
    return click.confirm(f"{question}?", default=False)


@click.command(short_help="Create or upgrade the store's schema.")
@with_store_options
def migrate(app: str | None, store_url: str | None, store_options: Sequence[Any]) -> None:
    """Create or upgrade the store's schema (idempotent), and say what was done: "created
    schema v5", "upgraded 4 -> 5" or "already at v5"."""
    with open_outbox(
        app=app, store_url=store_url, store_options=store_options, migrating=True
    ) as outbox:
        done = outbox.migrate()
        echo(f"{done if done is not None else 'schema up to date'}: {outbox.store!r}")


@click.command(short_help="Counts by state and topic, oldest due age, dead letters, leases.")
@with_store_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(
    app: str | None, store_url: str | None, store_options: Sequence[Any], as_json: bool
) -> None:
    """Events by state and topic; the age of the oldest due event (events parked for a retry
    backoff do not count: they are not due); dead letters; leases in flight."""
    with open_outbox(
        app=app, store_url=store_url, store_options=store_options, existing=True
    ) as outbox:
        policy = dead_key_policy(outbox, app)
        stats = outbox.stats()
        keys = dead_keys(outbox, limit=KEYS_SHOWN) if stats.dead_keys else []
        data = _status_json(outbox, stats, outbox.now(), policy, keys)
    if as_json:
        print_json(data)
        return
    echo(f"store: {data['store']}")
    echo(
        f"events: {stats.pending} pending, {stats.claimed} in flight (leased), "
        f"{stats.published} published, {stats.dead} dead"
    )
    if stats.oldest_due_at is None:
        echo("oldest due: none (nothing is waiting)")
    else:
        oldest = age(data["oldest_due_age_seconds"])
        echo(f"oldest due: {oldest} ago ({stats.oldest_due_at.isoformat()})")
    echo(f"dead letters: {stats.dead}" + ("  (outboxkit dead list)" if stats.dead else ""))
    echo(f"in-flight leases: {stats.claimed}")
    echo(f"dead-key policy: {_describe_policy(policy)}")
    echo(f"keys with a dead event: {stats.dead_keys} ({_held_or_not(policy)})")
    for entry in keys:
        echo(f"  {_describe_dead_key(entry)}")
    if stats.dead_keys > len(keys):
        echo(f"  ... and {stats.dead_keys - len(keys)} more (outboxkit dead list)")
    if data["by_topic"]:
        rows = [
            [topic, c["pending"], c["in_flight"], c["published"], c["dead"]]
            for topic, c in data["by_topic"].items()
        ]
        echo("")
        echo(table(["TOPIC", "PENDING", "IN FLIGHT", "PUBLISHED", "DEAD"], rows))


KEYS_SHOWN = 20  # keys with a dead event named by `status` (all are counted)


def dead_key_policy(outbox: Outbox, app: str | None) -> DeadKey | None:
    """The app's ``dead_key``, or None (unknown) without ``--app``: the store does not record
    the policy, and an outbox made on a bare store URL has only the default, not the app's."""
    return outbox.dead_key if app is not None else None


def _describe_policy(policy: DeadKey | None) -> str:
    if policy is None:
        return (
            "unknown (the store does not record the app's dead_key; "
            "pass --app module:attribute to read it)"
        )
    return f"dead_key={policy!r} (the app's)"


def _held_or_not(policy: DeadKey | None) -> str:
    if policy == "hold":
        return "held: their later events wait until the dead event is requeued or purged"
    if policy == "release":
        return "not held: dead_key='release', their later events go on"
    return "held only if the app's dead_key is 'hold'"


def _describe_dead_key(entry: DeadEventKey) -> str:
    event = entry.dead.event
    return (
        f"key {clip(entry.key, 60)!r}: dead event {event.id} ({clip(event.topic, 60)}, "
        f"failed {entry.dead.failed_at.isoformat(timespec='seconds')})"
    )


# -- dead letters -------------------------------------------------------------------------------


@click.group(short_help="List, show, requeue and purge dead letters.")
def dead() -> None:
    """Dead letters: events whose retries were used up."""


@dead.command("list")
@with_store_options
@click.option("--topic", default=None, help="Only this topic.")
@click.option(
    "--since", type=Since(), default=None, help="Failed within this long (1h) or since an instant."
)
@click.option(
    "--limit", type=Whole(min=1), default=100, show_default=True, help="At most this many."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output, with payloads.")
def dead_list(
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
    topic: str | None,
    since: timedelta | datetime | None,
    limit: int,
    as_json: bool,
) -> None:
    """Dead letters, oldest failure first, printed as they are read (a page at a time, so
    memory stays bounded however many there are), with the key each holds."""
    with open_outbox(
        app=app, store_url=store_url, store_options=store_options, existing=True
    ) as outbox:
        policy = dead_key_policy(outbox, app)
        letters = iter_dead_letters(outbox, topic=topic, since=since, limit=limit)
        if as_json:
            _print_json_list(letters, policy)
            return
        keyed: list[bool] = []
        count = _print_rows(letters, policy, keyed)
        if count == 0:
            echo("no dead letters")
            return
        echo(f"{count} dead letter(s)" + (f" (--limit {limit})" if count == limit else ""))
        # The count of keys costs a read of the counts: only when a listed letter had a key.
        dead_key_count = outbox.stats().dead_keys if keyed else 0
    if dead_key_count:
        echo(f"dead-key policy: {_describe_policy(policy)}")
        echo(f"keys with a dead event: {dead_key_count} ({_held_or_not(policy)})")


_LIST_COLUMNS = (("ID", 10, ">"), ("TOPIC", 28, "<"), ("ATTEMPTS", 8, ">"))
_LIST_TAIL = (("FAILED AT", 25, "<"), ("KEY", 30, "<"), ("LAST ERROR", 0, "<"))


def _print_rows(letters: Iterator[DeadLetter], policy: DeadKey | None, keyed: list[bool]) -> int:
    """One line per dead letter, in fixed columns (the rows are not all known up front),
    printed a page at a time; ``keyed`` gets an entry when one has a key."""
    count = 0
    lines: list[str] = []
    for letter in letters:
        if count == 0:
            lines.append(_row([title for title, _, _ in _LIST_COLUMNS + _LIST_TAIL]))
        event = letter.event
        key = "" if event.key is None else clip(event.key, 60)
        if key and not keyed:
            keyed.append(True)
        if key and policy == "hold":
            key += " (held)"
        lines.append(
            _row(
                [
                    str(event.id),
                    one_line(event.topic),  # whole: a wider one pushes the row on
                    str(event.attempts),
                    letter.failed_at.isoformat(timespec="seconds"),
                    key,
                    clip(letter.last_error or "", 60),
                ]
            )
        )
        count += 1
        if len(lines) >= DEFAULT_PAGE_SIZE:
            echo("\n".join(lines))
            lines.clear()
    if lines:
        echo("\n".join(lines))
    return count


def _row(cells: Sequence[str]) -> str:
    widths = _LIST_COLUMNS + _LIST_TAIL
    return "  ".join(
        f"{cell:{align}{width}}" if width else cell
        for cell, (_, width, align) in zip(cells, widths, strict=True)
    ).rstrip()


def _print_json_list(letters: Iterator[DeadLetter], policy: DeadKey | None) -> int:
    """A JSON array written one element at a time."""
    count = 0
    echo("[")
    for letter in letters:
        held = None if policy is None or letter.event.key is None else policy == "hold"
        element = printable_json({**_dead_json(letter), "key_held": held})
        if count:
            echo(",")
        echo("\n".join(f"  {line}" for line in element.splitlines()))
        count += 1
    echo("]")
    return count


@dead.command("show")
@click.argument("event_id", metavar="ID", type=EVENT_ID)
@with_store_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def dead_show(
    event_id: int,
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
    as_json: bool,
) -> None:
    """One dead letter: payload, attempts, last error, which handlers succeeded or rejected it."""
    with open_outbox(
        app=app, store_url=store_url, store_options=store_options, existing=True
    ) as outbox:
        letter = _dead_or_fail(outbox, event_id)
        subscribed = [s.name for s in outbox.bus.handlers_for(letter.event.topic)]
    recorded = {r.handler for r in letter.records}
    missing = [name for name in subscribed if name not in recorded]
    if as_json:
        print_json({**_dead_json(letter), "handlers_without_record": missing if app else None})
        return
    event = letter.event
    echo(f"dead letter {event.id} ({event.topic})")
    echo(f"  created:    {_iso(event.created_at)}")
    echo(f"  failed:     {letter.failed_at.isoformat()}")
    echo(f"  attempts:   {event.attempts}")
    echo(f"  last error: {letter.last_error or '-'}")
    if event.key is not None:
        echo(f"  key:        {event.key}")
    if event.headers:
        echo(f"  headers:    {json.dumps(dict(event.headers), ensure_ascii=False)}")
    echo("  handlers:")
    if not letter.records and not missing:
        echo("    no handler recorded an outcome")
    for record in letter.records:
        reason = f": {record.reason}" if record.reason else ""
        echo(f"    {record.handler}: {record.outcome.value} on attempt {record.attempt}{reason}")
    for name in missing:
        echo(f"    {name}: no record (runs again if requeued)")
    if app is None:
        echo("    (with --app, the subscribed handlers without a record are listed too)")
    echo("  payload:")
    text = json.dumps(_event_json(event)["payload"], indent=2, ensure_ascii=False)
    for line in text.splitlines():
        echo(f"    {line}")


def _dead_or_fail(outbox: Outbox, event_id: int) -> DeadLetter:
    letter: DeadLetter | None = outbox.dead_letter(event_id)
    if letter is not None:
        return letter
    event = outbox.store.get(event_id)
    if event is None:
        raise InputError(f"no dead letter with id {event_id}: there is no event with that id")
    raise InputError(f"event {event_id} is not a dead letter (it is {event.state.value})")


def _check_dead(outbox: Outbox, ids: Sequence[int]) -> None:
    """All of ``ids`` are dead letters, or nothing is done: one bad id refuses the lot."""
    problems = []
    for event_id in dict.fromkeys(ids):
        if outbox.dead_letter(event_id) is not None:
            continue
        event = outbox.store.get(event_id)
        problems.append(
            f"{event_id} (no such event)" if event is None else f"{event_id} ({event.state.value})"
        )
    if problems:
        raise InputError(f"not dead letters, nothing done: {', '.join(problems)}")


@dead.command("requeue")
@click.argument("ids", metavar="[ID]...", nargs=-1, type=EVENT_ID)
@click.option("--all", "every", is_flag=True, help="Every dead letter (of --topic).")
@click.option("--topic", default=None, help="With --all: only this topic.")
@destructive
@with_store_options
def dead_requeue(
    ids: Sequence[int],
    every: bool,
    topic: str | None,
    dry_run: bool,
    yes: bool,
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
) -> None:
    """Make dead letters due again with their attempts reset; handlers that already succeeded
    or rejected them are not run again. Give IDs, or --all (with --topic): --all asks first
    on a terminal, and needs --yes elsewhere. --all takes the dead letters of the instant it
    starts (by the store's clock), each once: one that pollers dead-letter again meanwhile
    stays dead."""
    if bool(ids) == every:
        raise click.UsageError("give dead-letter IDs or --all, not both")
    if topic is not None and not every:
        raise click.UsageError("--topic goes with --all")
    if every:
        _refuse_without_terminal("dead requeue --all", yes=yes, dry_run=dry_run)
    with open_outbox(
        app=app, store_url=store_url, store_options=store_options, existing=True
    ) as outbox:
        if not every:
            _check_dead(outbox, ids)
            count = len(dict.fromkeys(ids)) if dry_run else outbox.requeue(ids)
        else:
            # One snapshot, by the store's clock, for the count asked about and the requeue:
            # the dead letters of that instant, each requeued once, whatever dies meanwhile.
            as_of = outbox.now()
            count = outbox.requeue_dead(topic=topic, dry_run=True, as_of=as_of)
            of = "" if topic is None else f" of topic {topic!r}"
            if not dry_run:
                if not _confirmed(f"requeue {count} dead letter(s){of}", count, yes=yes):
                    echo("nothing requeued")
                    return
                count = outbox.requeue_dead(topic=topic, as_of=as_of)
            snapshot = f" (dead at {as_of.isoformat()}; any that fail again stay dead)"
            echo(f"{'would requeue' if dry_run else 'requeued'} {count} dead letter(s){snapshot}")
            return
    echo(f"{'would requeue' if dry_run else 'requeued'} {count} dead letter(s)")


@dead.command("purge")
@click.argument("ids", metavar="[ID]...", nargs=-1, type=EVENT_ID)
@click.option(
    "--older-than", type=DURATION, default=None, help="Dead letters failed this long ago."
)
@destructive
@with_store_options
def dead_purge(
    ids: Sequence[int],
    older_than: timedelta | None,
    dry_run: bool,
    yes: bool,
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
) -> None:
    """Delete dead letters (and their delivery records): IDs, or --older-than 30d. Asks first
    on a terminal; needs --yes elsewhere."""
    if bool(ids) == (older_than is not None):
        raise click.UsageError("give dead-letter IDs or --older-than, not both")
    _refuse_without_terminal("dead purge", yes=yes, dry_run=dry_run)
    with open_outbox(
        app=app, store_url=store_url, store_options=store_options, existing=True
    ) as outbox:
        if ids:
            _check_dead(outbox, ids)
        criteria: dict[str, Any] = {"dead_ids": ids} if ids else {"dead_older_than": older_than}
        count = outbox.purge(**criteria, dry_run=True)
        if dry_run:
            echo(f"would purge {count} dead letter(s)")
            return
        if not _confirmed(f"delete {count} dead letter(s) for good", count, yes=yes):
            echo("nothing purged")
            return
        count = outbox.purge(**criteria)
    echo(f"purged {count} dead letter(s)")


# -- retention ----------------------------------------------------------------------------------


@click.command(short_help="Delete old published events now.")
@click.option(
    "--published-older-than",
    "older_than",
    type=DURATION,
    required=True,
    help="Published this long ago or more, e.g. 7d.",
)
@destructive
@with_store_options
def purge(
    older_than: timedelta,
    dry_run: bool,
    yes: bool,
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
) -> None:
    """Delete published events (and their delivery records) older than --published-older-than,
    in pages of 1,000 rows. Pending events and dead letters are never touched. Pollers do the
    same once a minute for the outbox's retain_published (7 days by default). Asks first on a
    terminal; needs --yes elsewhere."""
    _refuse_without_terminal("purge", yes=yes, dry_run=dry_run)
    age = format_duration(older_than)
    with open_outbox(
        app=app, store_url=store_url, store_options=store_options, existing=True
    ) as outbox:
        count = outbox.purge(published_older_than=older_than, dry_run=True)
        if dry_run:
            echo(f"would purge {count} published event(s) older than {age}")
            return
        question = f"delete {count} published event(s) older than {age}"
        if not _confirmed(question, count, yes=yes):
            echo("nothing purged")
            return
        count = outbox.purge(published_older_than=older_than)
    echo(f"purged {count} published event(s) older than {age}")
