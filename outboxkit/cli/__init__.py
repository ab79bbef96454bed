"""The ``outboxkit`` command: run pollers, operate a store, try the demo, check a store.

Commands: ``run`` (pollers, ``outboxkit._runner``), ``migrate``, ``status``, ``dead list|show|
requeue|purge``, ``purge``, ``demo``, ``conformance``. The operations call the same ``Outbox``
methods an app calls in Python.

Errors are one line on stderr, never a traceback: wrong input (an APP that does not import, an
attribute that is not an ``Outbox``, an unknown store scheme, a bad duration, an id that is not a
dead letter) exits with 2; a store failure (the database is down, the schema is missing) with 1.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from .. import __version__
from ..core.model import DeadLetter, DeliveryRecord, Event, Stats, UndecodablePayload
from ..core.text import printable, printable_json, redact_url
from ..errors import ConfigurationError, OutboxError
from ..outbox import Outbox

__all__ = ["STORE_ENV", "STORE_OPTIONS_ENV", "cli", "load_app", "main", "parse_duration"]

STORE_ENV = "OUTBOXKIT_STORE"
"""The environment variable naming the store URL when ``--store`` is not given."""
STORE_OPTIONS_ENV = "OUTBOXKIT_STORE_OPTIONS"
"""The environment variable holding store options as a JSON object, when no ``-o`` is given
(how ``run --processes`` hands its children the store without putting it on a command line)."""

F = TypeVar("F", bound=Callable[..., Any])

# -- errors -----------------------------------------------------------------------------------


class InputError(click.ClickException):
    """Wrong input that is not a usage error as click sees it (an id that is not a dead letter,
    an APP that does not import): exit code 2, like a usage error."""

    exit_code = 2


def _one_line(text: str) -> str:
    """``text`` on one line, safe for a terminal (stored text may carry escape sequences)."""
    return printable(" ".join(str(text).split()))


def _echo(text: str = "", *, err: bool = False) -> None:
    """Every line the CLI prints goes through here: whatever stored text it holds (topics,
    keys, reasons, errors, payloads), no control character reaches the terminal or the pipe."""
    click.echo(printable(text, newlines=True), err=err)


def _fail(message: str, code: int) -> NoReturn:
    _echo(f"Error: {_one_line(message)}", err=True)
    sys.exit(code)


class _Cli(click.Group):
    """A group whose errors are one line on stderr (click's own print a usage block)."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            result = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.Abort:
            _fail("aborted", 1)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except ConfigurationError as exc:
            _fail(str(exc), 2)
        except OutboxError as exc:
            _fail(str(exc), 1)
        sys.exit(result if isinstance(result, int) else 0)


# -- parameter types ----------------------------------------------------------------------------

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?|\.\d+)(ms|s|m|h|d|w)?$")
_EXACT_UNITS = (  # microseconds per unit, for format_duration
    ("d", 86_400_000_000),
    ("h", 3_600_000_000),
    ("m", 60_000_000),
    ("s", 1_000_000),
    ("ms", 1_000),
)
DURATION_HELP = "use e.g. 30d, 12h, 15m, 10s or 500ms; a bare number is seconds"


def parse_duration(text: str) -> timedelta:
    """``"30d"``, ``"12h"``, ``"15m"``, ``"10s"``, ``"500ms"`` (or ``"1.5"`` seconds) as a timedelta.

    Raises:
        ValueError: not such a duration (negative ones are not).
    """
    match = _DURATION_RE.match(text.strip().lower()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{text!r} is not a duration: {DURATION_HELP}")
    number, unit = match.groups()
    try:
        return timedelta(seconds=float(number) * _UNITS[unit or "s"])
    except OverflowError:
        raise ValueError(f"{text!r} is too long a duration") from None


def format_duration(delta: timedelta) -> str:
    """A duration as ``parse_duration`` reads it back, in the largest exact unit (``7d``,
    ``90s``, ``500ms``)."""
    micros = delta // timedelta(microseconds=1)
    if micros == 0:
        return "0s"
    for unit, size in _EXACT_UNITS:
        if micros % size == 0:
            return f"{micros // size}{unit}"
    return f"{micros / 1000:.3f}ms"


class Duration(click.ParamType):  # type: ignore[type-arg,unused-ignore]
    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Since(click.ParamType):  # type: ignore[type-arg,unused-ignore]
    """A duration back from now (``1h``) or an ISO-8601 instant (``2030-01-01T00:00:00Z``)."""

    name = "since"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, timedelta | datetime):
            return value
        try:
            return parse_duration(str(value))
        except ValueError:
            pass
        from ..clock import parse_instant

        try:
            return parse_instant(str(value))
        except ValueError:
            self.fail(
                f"{value!r} is neither a duration nor an ISO-8601 instant with a time zone: "
                f"{DURATION_HELP}, or e.g. 2030-01-31T12:00:00Z",
                param,
                ctx,
            )


class StoreOption(click.ParamType):  # type: ignore[type-arg,unused-ignore]
    """``KEY=VALUE``; the value is read as JSON when it parses (``5``, ``true``), else a string."""

    name = "key=value"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        key, sep, raw = str(value).partition("=")
        if not sep or not key.strip():
            self.fail(f"{value!r} is not KEY=VALUE", param, ctx)
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw
        return (key.strip(), parsed)


DURATION = Duration()

# -- apps and stores ----------------------------------------------------------------------------


def load_app(spec: str) -> Outbox:
    """The ``Outbox`` that ``module:attribute`` names; the working directory is importable.

    Raises:
        InputError: the spec is malformed, the module does not import, the attribute is
            missing or not an ``Outbox``.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise InputError(f"APP must be module:attribute (e.g. myapp.events:outbox), got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise InputError(
            f"cannot import {module_name!r} for APP {spec!r}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        for part in attribute.split("."):
            target = getattr(target, part)
    except AttributeError:
        raise InputError(f"APP {spec!r}: {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(target, Outbox):
        raise InputError(f"APP {spec!r} is a {type(target).__name__}, not an outboxkit.Outbox")
    return target


def _open_store(url: str, options: Mapping[str, Any]) -> Any:
    from ..plugins import open_store

    try:
        return open_store(url, **options)
    except ConfigurationError as exc:
        raise InputError(f"store {redact_url(url)!r}: {exc}") from None


@contextmanager
def open_outbox(
    *, app: str | None, store_url: str | None, store_options: Sequence[tuple[str, Any]]
) -> Iterator[Outbox]:
    """The outbox an ops command works on: the APP's, rebound to ``store_url`` if one is
    given (``--store`` or ``OUTBOXKIT_STORE``), or a plain one on ``store_url``. A store opened
    here is closed at the end.

    Raises:
        InputError: neither is given, or either is wrong.
    """
    options = dict(store_options) or _options_from_env()
    if options and not store_url:
        raise InputError("--store-option needs --store URL (or OUTBOXKIT_STORE)")
    if app is None and not store_url:
        raise InputError(
            f"no store: pass --store URL, set {STORE_ENV}, or pass --app module:attribute"
        )
    outbox = load_app(app) if app is not None else None
    store = _open_store(store_url, options) if store_url else None
    try:
        if store is None:
            assert outbox is not None
            yield outbox
        elif outbox is None:
            yield Outbox(store)
        else:
            yield outbox.rebind(store=store)
    finally:
        if store is not None:
            store.close()


def _options_from_env() -> dict[str, Any]:
    raw = os.environ.get(STORE_OPTIONS_ENV)
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise InputError(f"{STORE_OPTIONS_ENV} must hold a JSON object of store options")
    return options


def _store_options(fn: F) -> F:
    """``--store``, ``--store-option`` and ``--app``, for the ops commands."""
    fn = click.option(
        "--app",
        "app",
        metavar="APP",
        default=None,
        help="module:attribute naming your Outbox (its store, unless --store is given).",
    )(fn)
    fn = click.option(
        "-o",
        "--store-option",
        "store_options",
        type=StoreOption(),
        multiple=True,
        help="An option for the store, e.g. -o schema=outbox (repeatable).",
    )(fn)
    fn = click.option(
        "--store",
        "store_url",
        envvar=STORE_ENV,
        show_envvar=True,
        metavar="URL",
        default=None,
        help="The store URL: sqlite:///app.db, postgresql://user@host/db, ...",
    )(fn)
    return fn


# -- output -------------------------------------------------------------------------------------


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [
        [str(h) for h in headers],
        *[["" if c is None else printable(c) for c in r] for r in rows],
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(isinstance(r[i], int) for r in rows) and bool(rows) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            cell.rjust(widths[i]) if numeric[i] else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _json(data: object) -> None:
    _echo(printable_json(data))


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


def _status_json(outbox: Outbox, stats: Stats, now: datetime) -> dict[str, Any]:
    age = None if stats.oldest_due_at is None else (now - stats.oldest_due_at).total_seconds()
    return {
        "store": repr(outbox.store),
        "now": _iso(now),
        "pending": stats.pending,
        "in_flight": stats.claimed,
        "published": stats.published,
        "dead": stats.dead,
        "total": stats.total,
        "oldest_due_at": _iso(stats.oldest_due_at),
        "oldest_due_age_seconds": age,
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


# -- the group ----------------------------------------------------------------------------------


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="outboxkit")
def cli() -> None:
    """outboxkit: a transactional outbox for Python.

    Ops commands find the store with --store URL (or OUTBOXKIT_STORE), or --app
    module:attribute naming your Outbox. Durations: 30d, 12h, 15m, 10s, 500ms.
    """


# -- run ----------------------------------------------------------------------------------------


@cli.command(short_help="Run pollers for an app's outbox.")
@click.argument("app")
@click.option(
    "--store",
    "store_url",
    envvar=STORE_ENV,
    show_envvar=True,
    metavar="URL",
    default=None,
    help="Poll this store instead of the app's own.",
)
@click.option(
    "-o",
    "--store-option",
    "store_options",
    type=StoreOption(),
    multiple=True,
    help="An option for --store, e.g. -o schema=outbox (repeatable).",
)
@click.option("--interval", type=DURATION, default=None, help="Wait between idle polls.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Events per claim.")
@click.option("--lease", type=DURATION, default=None, help="How long a claim is held.")
@click.option(
    "--max-retries",
    type=click.IntRange(min=0),
    default=None,
    help="Retries before an event is dead-lettered.",
)
@click.option(
    "--transaction",
    type=click.Choice(["per_event", "per_batch"]),
    default=None,
    help="One transaction per delivery (default), or one per claimed batch with a savepoint "
    "per delivery (fewer commits; stores with the batched_delivery capability).",
)
@click.option("--until-idle", is_flag=True, help="Drain what is due now, then exit 0.")
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Poller processes; one that dies is restarted.",
)
@click.option(
    "--grace",
    type=DURATION,
    default="30s",
    show_default=True,
    help="On SIGTERM/SIGINT, how long to finish the event in hand before exiting anyway.",
)
@click.option(
    "--log-every",
    type=DURATION,
    default="60s",
    show_default=True,
    help="How often to log the one-line summary.",
)
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    show_default=True,
)
def run(
    app: str,
    store_url: str | None,
    store_options: Sequence[tuple[str, Any]],
    interval: timedelta | None,
    batch_size: int | None,
    lease: timedelta | None,
    max_retries: int | None,
    transaction: str | None,
    until_idle: bool,
    processes: int,
    grace: timedelta,
    log_every: timedelta,
    log_level: str,
) -> None:
    """Run pollers for APP (module:attribute naming an Outbox) until SIGTERM or SIGINT.

    The store is --store (or OUTBOXKIT_STORE), else the app's own. On SIGTERM/SIGINT each
    poller finishes the event in hand, releases the rest of its batch at once and exits 0; past
    --grace, or on a second signal, it exits 1 at once (the event in hand recovers by its
    lease). A summary line is logged every --log-every: published/s, pending, oldest due
    age, dead letters.
    """
    from . import runner as _runner

    if log_every <= timedelta(0):
        raise click.BadParameter("must be > 0", param_hint="'--log-every'")
    poller_options: dict[str, Any] = {
        name: value
        for name, value in (
            ("interval", interval),
            ("batch_size", batch_size),
            ("lease", lease),
            ("max_retries", max_retries),
            ("transaction", transaction),
        )
        if value is not None
    }
    settings = _runner.RunSettings(
        app=app,
        store_url=store_url or None,
        store_options=tuple(store_options),
        poller_options=poller_options,
        until_idle=until_idle,
        processes=processes,
        grace=grace,
        log_every=log_every,
        log_level=log_level.upper(),
    )
    sys.exit(_runner.run(settings))


# -- migrate, status ----------------------------------------------------------------------------


@cli.command(short_help="Create or upgrade the store's schema.")
@_store_options
def migrate(app: str | None, store_url: str | None, store_options: Sequence[Any]) -> None:
    """Create or upgrade the store's schema (idempotent)."""
    with open_outbox(app=app, store_url=store_url, store_options=store_options) as outbox:
        outbox.migrate()
        _echo(f"schema up to date: {outbox.store!r}")


@cli.command(short_help="Counts by state and topic, oldest due age, dead letters, leases.")
@_store_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(
    app: str | None, store_url: str | None, store_options: Sequence[Any], as_json: bool
) -> None:
    """Events by state and topic; the age of the oldest due event (events parked for a retry
    backoff do not count: they are not due); dead letters; leases in flight."""
    with open_outbox(app=app, store_url=store_url, store_options=store_options) as outbox:
        stats = outbox.stats()
        data = _status_json(outbox, stats, outbox.now())
    if as_json:
        _json(data)
        return
    _echo(f"store: {data['store']}")
    _echo(
        f"events: {stats.pending} pending, {stats.claimed} in flight (leased), "
        f"{stats.published} published, {stats.dead} dead"
    )
    if stats.oldest_due_at is None:
        _echo("oldest due: none (nothing is waiting)")
    else:
        age = _age(data["oldest_due_age_seconds"])
        _echo(f"oldest due: {age} ago ({stats.oldest_due_at.isoformat()})")
    _echo(f"dead letters: {stats.dead}" + ("  (outboxkit dead list)" if stats.dead else ""))
    _echo(f"in-flight leases: {stats.claimed}")
    if data["by_topic"]:
        rows = [
            [topic, c["pending"], c["in_flight"], c["published"], c["dead"]]
            for topic, c in data["by_topic"].items()
        ]
        _echo("")
        _echo(_table(["TOPIC", "PENDING", "IN FLIGHT", "PUBLISHED", "DEAD"], rows))


# -- dead letters -------------------------------------------------------------------------------


@cli.group(short_help="List, show, requeue and purge dead letters.")
def dead() -> None:
    """Dead letters: events whose retries were used up."""


@dead.command("list")
@_store_options
@click.option("--topic", default=None, help="Only this topic.")
@click.option(
    "--since", type=Since(), default=None, help="Failed within this long (1h) or since an instant."
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=100, show_default=True, help="At most this many."
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
    """Dead letters, oldest failure first."""
    with open_outbox(app=app, store_url=store_url, store_options=store_options) as outbox:
        letters = outbox.dead_letters(topic=topic, since=since, limit=limit)
    if as_json:
        _json([_dead_json(d) for d in letters])
        return
    if not letters:
        _echo("no dead letters")
        return
    rows = [
        [
            d.event.id,
            d.event.topic,
            d.event.attempts,
            d.failed_at.isoformat(timespec="seconds"),
            _clip(d.last_error or "", 60),
        ]
        for d in letters
    ]
    _echo(_table(["ID", "TOPIC", "ATTEMPTS", "FAILED AT", "LAST ERROR"], rows))
    _echo(f"{len(letters)} dead letter(s)" + (f" (--limit {limit})" if len(rows) == limit else ""))


def _clip(text: str, width: int) -> str:
    text = _one_line(text)
    return text if len(text) <= width else text[: width - 1] + "…"


@dead.command("show")
@click.argument("event_id", metavar="ID", type=int)
@_store_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def dead_show(
    event_id: int,
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
    as_json: bool,
) -> None:
    """One dead letter: payload, attempts, last error, which handlers succeeded or rejected it."""
    with open_outbox(app=app, store_url=store_url, store_options=store_options) as outbox:
        letter = _dead_or_fail(outbox, event_id)
        subscribed = [s.name for s in outbox.bus.handlers_for(letter.event.topic)]
    recorded = {r.handler for r in letter.records}
    missing = [name for name in subscribed if name not in recorded]
    if as_json:
        _json({**_dead_json(letter), "handlers_without_record": missing if app else None})
        return
    event = letter.event
    _echo(f"dead letter {event.id} ({event.topic})")
    _echo(f"  created:    {_iso(event.created_at)}")
    _echo(f"  failed:     {letter.failed_at.isoformat()}")
    _echo(f"  attempts:   {event.attempts}")
    _echo(f"  last error: {letter.last_error or '-'}")
    if event.key is not None:
        _echo(f"  key:        {event.key}")
    if event.headers:
        _echo(f"  headers:    {json.dumps(dict(event.headers), ensure_ascii=False)}")
    _echo("  handlers:")
    if not letter.records and not missing:
        _echo("    no handler recorded an outcome")
    for record in letter.records:
        reason = f": {record.reason}" if record.reason else ""
        _echo(f"    {record.handler}: {record.outcome.value} on attempt {record.attempt}{reason}")
    for name in missing:
        _echo(f"    {name}: no record (runs again if requeued)")
    if app is None:
        _echo("    (with --app, the subscribed handlers without a record are listed too)")
    _echo("  payload:")
    text = json.dumps(_event_json(event)["payload"], indent=2, ensure_ascii=False)
    for line in text.splitlines():
        _echo(f"    {line}")


def _dead_or_fail(outbox: Outbox, event_id: int) -> DeadLetter:
    letter: DeadLetter | None = outbox.dead_letter(event_id)
    if letter is not None:
        return letter
    event = outbox.store.get(event_id)
    if event is None:
        raise InputError(f"no dead letter with id {event_id}: there is no event with that id")
    raise InputError(f"event {event_id} is not a dead letter (it is {event.state.value})")


def _check_dead(outbox: Outbox, ids: Sequence[int]) -> None:
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
@click.argument("ids", metavar="[ID]...", nargs=-1, type=int)
@click.option("--all", "every", is_flag=True, help="Every dead letter (of --topic).")
@click.option("--topic", default=None, help="With --all: only this topic.")
@_store_options
def dead_requeue(
    ids: Sequence[int],
    every: bool,
    topic: str | None,
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
) -> None:
    """Make dead letters due again with their attempts reset; handlers that already succeeded
    or rejected them are not run again. Give IDs, or --all (with --topic)."""
    if bool(ids) == every:
        raise click.UsageError("give dead-letter IDs or --all, not both")
    if topic is not None and not every:
        raise click.UsageError("--topic goes with --all")
    with open_outbox(app=app, store_url=store_url, store_options=store_options) as outbox:
        if every:
            count = outbox.requeue_dead(topic=topic)
        else:
            _check_dead(outbox, ids)
            count = outbox.requeue(ids)
    _echo(f"requeued {count} dead letter(s)")


@dead.command("purge")
@click.argument("ids", metavar="[ID]...", nargs=-1, type=int)
@click.option(
    "--older-than", type=DURATION, default=None, help="Dead letters failed this long ago."
)
@_store_options
def dead_purge(
    ids: Sequence[int],
    older_than: timedelta | None,
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
) -> None:
    """Delete dead letters (and their delivery records): IDs, or --older-than 30d."""
    if bool(ids) == (older_than is not None):
        raise click.UsageError("give dead-letter IDs or --older-than, not both")
    with open_outbox(app=app, store_url=store_url, store_options=store_options) as outbox:
        if ids:
            _check_dead(outbox, ids)
            count = outbox.purge(dead_ids=ids)
        else:
            count = outbox.purge(dead_older_than=older_than)
    _echo(f"purged {count} dead letter(s)")


# -- retention ----------------------------------------------------------------------------------


@cli.command(short_help="Delete old published events now.")
@click.option(
    "--published-older-than",
    "older_than",
    type=DURATION,
    required=True,
    help="Published this long ago or more, e.g. 7d.",
)
@_store_options
def purge(
    older_than: timedelta,
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
) -> None:
    """Delete published events (and their delivery records) older than --published-older-than,
    in pages of 1,000 rows. Pending events and dead letters are never touched. Pollers do the
    same once a minute for the outbox's retain_published (7 days by default)."""
    with open_outbox(app=app, store_url=store_url, store_options=store_options) as outbox:
        count = outbox.purge(published_older_than=older_than)
    _echo(f"purged {count} published event(s) older than {format_duration(older_than)}")


# -- demo ---------------------------------------------------------------------------------------


@cli.command(short_help="Run the example shop on a SQLite file and show what happened.")
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The SQLite file (default: outboxkit-demo.db in the current directory).",
)
@click.option(
    "--orders", type=click.IntRange(min=1), default=300, show_default=True, help="Orders to place."
)
def demo(db: Path | None, orders: int) -> None:
    """Place orders in the example shop (outboxkit_shop), deliver them to its three handlers
    (fraud-check rejects big orders, reserve-stock writes the stock table, send-receipt calls a
    flaky mail server that is retried), and print what happened, per handler."""
    from outboxkit_shop.demo import DEFAULT_DB, main

    path = db if db is not None else Path(DEFAULT_DB)
    if not path.parent.is_dir():
        raise InputError(f"--db {str(path)!r}: the directory {str(path.parent)!r} does not exist")
    _echo(f"placing {orders} orders in the shop on {path} ...")
    # The handlers' failures are the point of the demo: count them, do not print a traceback
    # for each (Python's last-resort handler would, with no logging configured).
    quiet = logging.NullHandler()
    logger = logging.getLogger("outboxkit")
    logger.addHandler(quiet)
    try:
        with click.progressbar(length=orders, label="delivering", file=sys.stderr) as bar:
            result = main(path, orders=orders, progress=bar.update)
    finally:
        logger.removeHandler(quiet)
    rows = [
        [name, t.published, t.rejected, t.retried, t.dead_lettered]
        for name, t in result.handlers.items()
    ]
    _echo("")
    _echo(_table(["HANDLER", "PUBLISHED", "REJECTED", "RETRIED", "DEAD-LETTERED"], rows))
    _echo("")
    _echo(
        f"{result.orders} orders: {result.published} events published, "
        f"{result.dead_lettered} dead-lettered, {result.pending} pending, "
        f"in {result.seconds:.1f}s"
    )
    url = _demo_url(path)
    store = shlex.quote(url)
    _echo("")
    _echo("where to look next:")
    _echo(f"  outboxkit status --store {store}")
    _echo(f"  outboxkit dead list --store {store}")
    _echo(f"  outboxkit dead show ID --store {store}")
    _echo(f"  outboxkit dead requeue --all --store {store}")
    _echo(
        f"  SHOP_DB={shlex.quote(url.removeprefix('sqlite:///'))} "
        "outboxkit run outboxkit_shop.app:outbox --until-idle"
    )


def _demo_url(path: Path) -> str:
    """The store URL to print: relative when the file is under the working directory."""
    resolved = path.resolve()
    try:
        shown = resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        shown = resolved.as_posix()
    return f"sqlite:///{shown}"


# -- conformance --------------------------------------------------------------------------------


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    short_help="Run the store conformance suite against a store factory.",
)
@click.argument("factory")
@click.argument("pytest_args", nargs=-1, type=click.UNPROCESSED)
def conformance(factory: str, pytest_args: Sequence[str]) -> None:
    """Run the store conformance suite against FACTORY (``module:callable``).

    The factory returns a fresh, empty, migrated store per test (it may take a ``tmp_path``
    argument, and may return a context manager yielding the store). Extra arguments go to
    pytest, e.g. ``-k claim -x``. Exits 0 when every test passed or was skipped.
    """
    import pytest

    import outboxkit_conformance as suite

    try:
        make = suite.load_factory(factory)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    capabilities = _capabilities(make)
    _echo(f"outboxkit conformance suite {suite.SUITE_VERSION} against {factory}")
    _echo(f"declared capabilities: {', '.join(sorted(capabilities)) or 'none'}")
    counter = _Counter()
    ini = Path(suite.__file__).with_name("conformance.ini")
    args = [
        "-c",
        str(ini),
        "--rootdir",
        str(ini.parent),
        "--pyargs",
        "outboxkit_conformance",
        f"--outbox-store-factory={factory}",
        "-q",
        *pytest_args,
    ]
    code = pytest.main(args, plugins=[counter])
    _echo(
        f"conformance: {counter.passed} passed, {counter.failed} failed, "
        f"{counter.skipped} skipped, {counter.xfailed} xfailed"
    )
    for name in counter.failures:
        _echo(f"FAILED {name}")
    sys.exit(int(code))


def _capabilities(make: Any) -> frozenset[str]:
    from outboxkit_conformance import call_factory

    with tempfile.TemporaryDirectory(prefix="outboxkit-conformance-") as tmp:
        try:
            made = call_factory(make, Path(tmp))
        except Exception as exc:
            raise click.ClickException(
                f"the store factory failed: {type(exc).__name__}: {exc}"
            ) from None
        if isinstance(made, AbstractContextManager):
            with made as store:
                return frozenset(getattr(store, "capabilities", ()))
        try:
            return frozenset(getattr(made, "capabilities", ()))
        finally:
            made.close()


class _Counter:
    """A pytest plugin counting outcomes, for the one-line summary."""

    def __init__(self) -> None:
        self.passed = self.failed = self.skipped = self.xfailed = 0
        self.failures: list[str] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
            self.passed += 1
        elif hasattr(report, "wasxfail") and report.skipped:
            self.xfailed += 1
        elif report.skipped:
            self.skipped += 1
        elif report.failed:
            self.failed += 1
            self.failures.append(report.nodeid)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``outboxkit`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="outboxkit")
