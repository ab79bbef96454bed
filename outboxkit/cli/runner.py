"""``outboxkit run``: pollers in this process, or N supervised poller processes.

The command (:func:`run_command`) and the shell around ``Poller.run_forever`` and, with
``--until-idle``, ``Poller.run_until_idle`` (:func:`run`); or the same two of ``AsyncPoller``
when the app's bus has ``async def`` handlers, or with ``--asyncio``. Theory of operation:

- One process (``--processes 1``, and every child): the poller runs in a worker thread (the
  asyncio poller on an event loop of that thread's own); the main thread only waits, so a
  signal is handled at once even while a handler blocks. The first
  SIGTERM/SIGINT calls the poller's ``stop()`` (thread-safe for both): the events in hand are
  finished and settled, the rest of the batch is released (its leases cleared, attempts
  refunded), and the process exits 0. If that takes longer than ``--grace``, or a second signal
  comes, it exits 1 at once; the events in hand are then recovered by their leases, as after a
  crash.
- N processes: the supervisor starts N children (``python -m outboxkit run ...`` with the same
  options), restarts one that dies (at once the first time, then with a growing delay while it
  keeps dying young), and forwards SIGTERM/SIGINT as SIGTERM; a second signal kills them. The
  children sit in their own process group (a terminal's Ctrl-C reaches only the supervisor) and
  stop on their own if the supervisor disappears.
- Every ``--log-every`` each process logs one line: published/s since the last line, pending,
  the oldest due event's age, dead letters, leases in flight.
- ``--metrics-port N`` serves Prometheus metrics (``outboxkit.contrib.prometheus``) for the
  whole group from the process that was started (the supervisor, with ``--processes N``): the
  children count into prometheus_client's multiprocess files, in a temporary directory the
  supervisor owns and removes when it exits, and only the supervisor listens; it reads the
  store's gauges at each scrape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import IO, Any, TypeVar

import click

from .. import calls
from ..aio import MAX_CONCURRENCY, AsyncPoller
from ..core.model import (
    DeadLettered,
    HandlerFailed,
    HandlerRejected,
    HandlerSucceeded,
    ObserverEvent,
    PollReport,
    Published,
)
from ..core.options import PollerOptions
from ..core.text import parse_decimal, printable
from ..errors import ConfigurationError
from ..hookspecs import hookimpl
from ..outbox import Outbox
from ..poller import Poller
from ..waiter import LoopWaiter, ThreadWaiter
from .errors import WRONG_INPUT
from .logs import command_logging
from .params import DURATION, StoreOption, Whole, format_duration
from .progress import DrainProgress, StatusLine
from .signals import stop_signals
from .stores import STORE_ENV, STORE_OPTIONS_ENV, open_outbox

__all__ = ["RunSettings", "run", "run_command"]

log = logging.getLogger("outboxkit.run")

SUPERVISOR_ENV = "OUTBOXKIT_SUPERVISOR_PID"
POLLER_ENV = "OUTBOXKIT_POLLER"
METRICS_ENV = "OUTBOXKIT_METRICS_CHILD"  # "1": count into the supervisor's multiprocess files
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_MAX_PID = 2**31 - 1  # the supervisor's pid, as its children read it from SUPERVISOR_ENV
_TICK = 0.1  # seconds between the main thread's checks (and its signal handlers' runs)

T = TypeVar("T")
Drive = Callable[[], list[PollReport]]
"""A poller's ``run_until_idle()``, blocking or run on an event loop to its end."""


@dataclass(frozen=True)
class RunSettings:
    """What ``outboxkit run`` was asked to do (validated by click)."""

    app: str
    store_url: str | None
    store_options: tuple[tuple[str, Any], ...]
    poller_options: dict[str, Any]
    until_idle: bool = False
    processes: int = 1
    grace: timedelta = timedelta(seconds=30)
    log_every: timedelta = timedelta(seconds=60)
    log_level: str = "INFO"
    asyncio: bool = False
    concurrency: int | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def child_argv(self) -> list[str]:
        """The command line of one child poller process. The store's URL and options are not on
        it (a command line is world-readable in ``/proc``, and a URL may hold a password): they
        go in the child's environment, see :meth:`child_env`."""
        argv = [sys.executable, "-m", "outboxkit", "run", self.app]
        for name, value in self.poller_options.items():
            text = format_duration(value) if isinstance(value, timedelta) else str(value)
            argv += [f"--{name.replace('_', '-')}", text]
        argv += ["--grace", format_duration(self.grace)]
        argv += ["--log-every", format_duration(self.log_every)]
        argv += ["--log-level", self.log_level]
        if self.asyncio:
            argv.append("--asyncio")
        if self.concurrency is not None:
            argv += ["--concurrency", str(self.concurrency)]
        if self.until_idle:
            argv.append("--until-idle")
        return argv

    def child_env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the store for a child: ``OUTBOXKIT_STORE`` and
        ``OUTBOXKIT_STORE_OPTIONS`` (a JSON object), readable by this user only."""
        env = {k: v for k, v in base.items() if k not in (STORE_ENV, STORE_OPTIONS_ENV)}
        if self.store_url:
            env[STORE_ENV] = self.store_url
        if self.store_options:
            env[STORE_OPTIONS_ENV] = json.dumps(dict(self.store_options))
        return env


@click.command("run", short_help="Run pollers for an app's outbox.")
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
@click.option("--batch-size", type=Whole(min=1), default=None, help="Events per claim.")
@click.option("--lease", type=DURATION, default=None, help="How long a claim is held.")
@click.option(
    "--max-retries",
    type=Whole(min=0),
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
@click.option(
    "--prefetch/--no-prefetch",
    default=None,
    help="Claim the next batch while one is delivered, after a full claim (PostgreSQL; "
    "elsewhere the poller claims as usual).",
)
@click.option(
    "--asyncio",
    "use_asyncio",
    is_flag=True,
    help="Run the asyncio poller (chosen anyway when the app has async def handlers).",
)
@click.option(
    "--concurrency",
    type=Whole(1, MAX_CONCURRENCY),
    default=None,
    help="How many deliveries may be in flight at once (default 1): the asyncio poller "
    "delivers N events of a batch at once; the blocking one runs its handlers one at a time and "
    "commits up to N records at once (PostgreSQL).",
)
@click.option("--until-idle", is_flag=True, help="Drain what is due now, then exit 0.")
@click.option(
    "--metrics-port",
    type=Whole(1, 65535),
    default=None,
    help="Serve Prometheus metrics on this port, at /metrics, for every poller process "
    '(needs "outboxkit[prometheus]").',
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="The address --metrics-port listens on.",
)
@click.option(
    "--processes",
    type=Whole(min=1),
    default=1,
    show_default=True,
    help="Poller processes; one that dies is restarted.",
)
@click.option(
    "--grace",
    type=DURATION,
    default="30s",
    show_default=True,
    help="On SIGTERM/SIGINT, how long to finish the events in hand before exiting anyway.",
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
def run_command(
    app: str,
    store_url: str | None,
    store_options: Sequence[tuple[str, Any]],
    interval: timedelta | None,
    batch_size: int | None,
    lease: timedelta | None,
    max_retries: int | None,
    transaction: str | None,
    prefetch: bool | None,
    use_asyncio: bool,
    concurrency: int | None,
    until_idle: bool,
    metrics_port: int | None,
    metrics_host: str,
    processes: int,
    grace: timedelta,
    log_every: timedelta,
    log_level: str,
) -> None:
    """Run pollers for APP (module:attribute naming an Outbox) until SIGTERM or SIGINT.

    The store is --store (or OUTBOXKIT_STORE), else the app's own. On SIGTERM/SIGINT each
    poller finishes the events in hand, releases the rest of its batch at once and exits 0;
    past --grace, or on a second signal, it exits 1 at once (the events in hand recover by
    their leases). A summary line is logged every --log-every: published/s, pending, oldest due
    age, dead letters.

    An app whose bus has async def handlers is run by the asyncio poller, as with --asyncio;
    --concurrency N then delivers N events of a batch at once. The blocking poller runs its
    handlers one at a time: with --concurrency N it commits up to N delivery records at once.
    """
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
            ("prefetch", prefetch),
        )
        if value is not None
    }
    settings = RunSettings(
        app=app,
        store_url=store_url or None,
        store_options=tuple(store_options),
        poller_options=poller_options,
        until_idle=until_idle,
        processes=processes,
        grace=grace,
        log_every=log_every,
        log_level=log_level.upper(),
        asyncio=use_asyncio,
        concurrency=concurrency,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    sys.exit(run(settings))


def run(settings: RunSettings) -> int:
    """Run ``outboxkit run``; returns the exit code.

    Raises:
        InputError, ConfigurationError: wrong input (the CLI reports it in one line, exit 2).
        StoreError: the store failed for good (a missing schema, say).
    """
    who = os.environ.get(POLLER_ENV)
    supervisor = os.environ.get(SUPERVISOR_ENV)
    prefix = f"[poller {who} pid {os.getpid()}] " if who else ""
    with (
        command_logging(settings.log_level, prefix) as status,
        open_outbox(
            app=settings.app,
            store_url=settings.store_url,
            store_options=settings.store_options,
            must_exist=True,
        ) as outbox,
    ):
        # Validate the options here, once, before any child is started.
        PollerOptions.build(outbox.options, **settings.poller_options)
        use_asyncio = _asyncio_wanted(outbox, settings)
        if settings.processes > 1:
            return _Supervisor(settings, outbox, status).run()
        return _run_here(
            outbox,
            settings,
            use_asyncio=use_asyncio,
            supervisor_pid=parse_decimal(supervisor, minimum=1, maximum=_MAX_PID),
            status=status,
        )


def _asyncio_wanted(outbox: Outbox, settings: RunSettings) -> bool:
    """Whether the asyncio poller runs: asked for (``--asyncio``), or needed by the app's
    ``async def`` handlers. Checks that it can (made once, with a waiter that holds nothing).

    Raises:
        ConfigurationError: the asyncio poller cannot run this app on this store (exit 2).
    """
    coroutines = calls.async_handlers(outbox.bus.specs())
    if not settings.asyncio and not coroutines:
        return False
    if not outbox.store.capabilities.asyncio:
        names = ", ".join(repr(spec.name) for spec in coroutines[:5])
        why = "--asyncio asks for" if settings.asyncio else f"async def handlers ({names}) need"
        raise ConfigurationError(
            f"{why} the asyncio poller, which needs a store with an asyncio side; "
            f"{outbox.store!r} has none (capabilities.asyncio is false)"
        )
    outbox.async_poller(
        concurrency=settings.concurrency or 1, waiter=LoopWaiter(), **settings.poller_options
    )
    return True


def _force_exit(message: str, *args: object) -> None:
    log.error(message, *args)
    for handler in logging.getLogger("outboxkit").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


# -- one process --------------------------------------------------------------------------------


class _Throughput:
    """Observer counting what became of events and handler runs, for the summary line (the
    per-event lines of successes and rejections are at DEBUG)."""

    def __init__(self) -> None:
        self.published = 0
        self.dead_lettered = 0
        self.runs = {"succeeded": 0, "rejected": 0, "failed": 0}
        self._lock = threading.Lock()

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        with self._lock:
            if isinstance(event, Published):
                self.published += 1
            elif isinstance(event, DeadLettered):
                self.dead_lettered += 1
            elif isinstance(event, HandlerSucceeded):
                self.runs["succeeded"] += 1
            elif isinstance(event, HandlerRejected):
                self.runs["rejected"] += 1
            elif isinstance(event, HandlerFailed):
                self.runs["failed"] += 1

    def take_runs(self) -> dict[str, int]:
        """The handler runs counted since the last call."""
        with self._lock:
            runs, self.runs = self.runs, dict.fromkeys(self.runs, 0)
        return runs


@dataclass
class _Stopping:
    """The first signal asks the poller to stop; past the grace time or at a second, exit."""

    stop: Callable[[], None]
    grace: float
    deadline: float | None = None
    reason: str = ""

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.deadline is not None:
            _force_exit(
                "second signal (%s): exiting now, the events in hand recover by their leases", name
            )
        self.request(f"{name} received")

    def request(self, reason: str) -> None:
        if self.deadline is not None:
            return
        self.reason = reason
        self.deadline = time.monotonic() + self.grace
        log.info(
            "%s: stopping; finishing the events in hand (grace %gs), releasing the rest",
            reason,
            self.grace,
        )
        self.stop()

    def check(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            _force_exit(
                "did not stop within the grace time (%gs): exiting now, the events in hand "
                "recover by their leases",
                self.grace,
            )


def _run_here(
    outbox: Outbox,
    settings: RunSettings,
    *,
    use_asyncio: bool,
    supervisor_pid: int | None,
    status: StatusLine,
) -> int:
    """Run one poller in a worker thread until it stops; the main thread handles signals."""
    outbox = outbox.rebind()  # our observer goes on a copy, never on the app's own outbox
    poller: Poller | AsyncPoller
    # A drain until idle never waits: no need for the store's wake-up waiter (a LISTEN
    # connection on Postgres) that only run_forever closes.
    if use_asyncio:
        poller = outbox.async_poller(
            concurrency=settings.concurrency or 1,
            waiter=LoopWaiter() if settings.until_idle else None,
            **settings.poller_options,
        )
    else:
        poller = outbox.poller(
            concurrency=settings.concurrency or 1,
            waiter=ThreadWaiter() if settings.until_idle else None,
            **settings.poller_options,
        )
    throughput = _Throughput()
    outbox.add_observer(throughput)
    server = None
    if os.environ.get(METRICS_ENV) == "1" and supervisor_pid is not None:
        from prometheus_client import CollectorRegistry

        from ..contrib.prometheus import Metrics

        # Counted into the supervisor's multiprocess files (a registry of our own: the app may
        # use the default one); the supervisor serves them.
        outbox.add_observer(Metrics(CollectorRegistry()))
    elif settings.metrics_port is not None:
        server, metrics = _serve_metrics(outbox, settings, multiprocess_dir=None)
        outbox.add_observer(metrics)
    # A supervised child shows no progress: its supervisor shows the group's.
    progress = (
        DrainProgress(outbox, status) if settings.until_idle and supervisor_pid is None else None
    )
    try:
        return _poll_here(
            outbox, poller, settings, throughput, supervisor_pid=supervisor_pid, progress=progress
        )
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


def _serve_metrics(
    outbox: Outbox, settings: RunSettings, *, multiprocess_dir: str | None
) -> tuple[Any, Any]:
    """``outboxkit.contrib.prometheus.serve`` for ``--metrics-port``, logged.

    Raises:
        ConfigurationError: the port cannot be bound (exit 2), or prometheus_client is missing.
    """
    from ..contrib.prometheus import serve

    host, port = settings.metrics_host, settings.metrics_port
    assert port is not None
    try:
        server, metrics = serve(outbox, port, host=host, multiprocess_dir=multiprocess_dir)
    except OSError as exc:
        raise ConfigurationError(
            f"--metrics-port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None
    log.info("serving metrics on http://%s:%d/metrics", host, server.server_port)
    return server, metrics


def _poll_here(
    outbox: Outbox,
    poller: Poller | AsyncPoller,
    settings: RunSettings,
    throughput: _Throughput,
    *,
    supervisor_pid: int | None,
    progress: DrainProgress | None,
) -> int:
    failure: list[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            log.info("polling %r with %r", outbox.store, poller)
            if isinstance(poller, AsyncPoller):
                # The asyncio poller runs on an event loop of this worker thread's own, from
                # start to end; the main thread stops it with the thread-safe stop().
                if settings.until_idle:
                    _drain_until_idle(
                        outbox,
                        lambda: asyncio.run(_closing(poller, poller.run_until_idle())),
                    )
                else:
                    asyncio.run(_closing(poller, poller.run_forever()))
            elif settings.until_idle:
                _drain_until_idle(outbox, poller.run_until_idle)
            else:
                poller.run_forever()
        except BaseException as exc:
            failure.append(exc)
        finally:
            done.set()

    stopping = _Stopping(poller.stop, settings.grace.total_seconds())
    summary = _Summary(outbox, throughput, settings.log_every.total_seconds())
    with stop_signals(stopping.on_signal):
        worker = threading.Thread(target=work, name="outboxkit-poller", daemon=True)
        if progress is not None:
            progress.maybe_show()  # drawn at once, however soon the drain ends
        worker.start()
        while not done.wait(_TICK):
            stopping.check()
            if supervisor_pid is not None and os.getppid() != supervisor_pid:
                stopping.request("the supervisor is gone")
            summary.maybe_log()
            if progress is not None:
                progress.maybe_show()
        worker.join()
    if settings.until_idle and not failure:
        summary.maybe_log(now_anyway=True)  # the counts since the last line, rejections too
    if progress is not None:
        progress.finish()  # the true last counts, kept above the log's end
    if failure:
        raise failure[0]
    if stopping.deadline is not None:
        log.info("stopped cleanly")
    return 0


@dataclass
class _Summary:
    """The periodic one-line summary."""

    outbox: Outbox
    throughput: _Throughput
    every: float
    _last_at: float = field(default_factory=time.monotonic)
    _last_published: int = 0

    def maybe_log(self, *, now_anyway: bool = False) -> None:
        """Log the line if ``every`` has passed since the last (or ``now_anyway``)."""
        now = time.monotonic()
        if now - self._last_at < self.every and not now_anyway:
            return
        published = self.throughput.published
        rate = (published - self._last_published) / (now - self._last_at)
        self._last_at, self._last_published = now, published
        runs = self.throughput.take_runs()
        handled = (
            f"handlers: {runs['succeeded']} succeeded, {runs['rejected']} rejected, "
            f"{runs['failed']} failed"
        )
        try:
            stats = self.outbox.stats()
        except Exception as exc:  # a store outage: the poller reports it; keep the line short
            log.info("%.1f published/s (%s); store unavailable: %s", rate, handled, exc)
            return
        if stats.oldest_due_at is None:
            oldest = "none"
        else:
            age = (self.outbox.now() - stats.oldest_due_at).total_seconds()
            oldest = f"{max(age, 0.0):.1f}s"
        log.info(
            "%.1f published/s, %d pending, oldest due %s, %d dead, %d in flight (%s)",
            rate,
            stats.pending,
            oldest,
            stats.dead,
            stats.claimed,
            handled,
        )


async def _closing(poller: AsyncPoller, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``, then close the store's asyncio side: its connections belong to this
    event loop, which ends with the run."""
    try:
        return await work
    finally:
        await poller.store.close()


def _drain_until_idle(outbox: Outbox, drive: Drive) -> None:
    """``--until-idle``: the poller's ``run_until_idle`` (until a poll claims nothing, or the
    poller is stopped) through ``drive``, and a summary line. (The progress is drawn by the
    main thread, see ``DrainProgress``.)"""
    reports = drive()
    outbox.prune_if_due()
    log.info(
        "drained: %d claimed, %d published, %d retried later, %d dead-lettered, "
        "%d lease(s) lost, %d released",
        sum(len(report.claimed) for report in reports),
        sum(len(report.published) for report in reports),
        sum(len(report.retried) for report in reports),
        sum(len(report.dead_lettered) for report in reports),
        sum(len(report.lease_lost) for report in reports),
        sum(len(report.released) for report in reports),
    )


# -- N processes --------------------------------------------------------------------------------


@dataclass
class _Child:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float = 0.0
    quick_deaths: int = 0
    restarts: int = 0
    finished: bool = False
    returncode: int | None = None


class _Supervisor:
    """Keeps N child poller processes running (see the module docstring)."""

    YOUNG = 10.0  # seconds: a child dying sooner than this is restarted after a growing delay
    MAX_DELAY = 30.0

    def __init__(self, settings: RunSettings, outbox: Outbox, status: StatusLine) -> None:
        self.settings = settings
        self.outbox = outbox
        self.status = status
        # One progress display for the group; on a terminal the children's log lines are
        # relayed through this process, above it (see ``_relay``).
        self.progress = DrainProgress(outbox, status) if settings.until_idle else None
        self.relays: list[threading.Thread] = []
        self.children = [_Child(i) for i in range(1, settings.processes + 1)]
        self.deadline: float | None = None
        self.wake = threading.Event()
        self.wrong_input = False
        self.metrics_dir: str | None = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.deadline is not None:
            self._signal_all(signal.SIGKILL)
            _force_exit("second signal (%s): killed the poller processes", name)
        self._stop_all(f"{name} received")

    def _stop_all(self, reason: str) -> None:
        if self.deadline is not None:
            return
        self.deadline = time.monotonic() + self.settings.grace.total_seconds()
        log.info("%s: stopping %d poller process(es)", reason, len(self.children))
        self._signal_all(signal.SIGTERM)
        self.wake.set()

    def _signal_all(self, sig: signal.Signals) -> None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                with suppress(ProcessLookupError):  # exited meanwhile
                    child.proc.send_signal(sig)

    def _start(self, child: _Child) -> None:
        n = len(self.children)
        env = self.settings.child_env(
            {**os.environ, SUPERVISOR_ENV: str(os.getpid()), POLLER_ENV: f"{child.index}/{n}"}
        )
        if self.metrics_dir is not None:
            env[MULTIPROC_ENV], env[METRICS_ENV] = self.metrics_dir, "1"
        # A child imports the app the way this process did: from where it was found.
        root = _import_root(self.settings.app)
        if root is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                [root, *filter(None, [os.environ.get("PYTHONPATH")])]
            )
        relayed = self.progress is not None and self.status.live
        child.proc = subprocess.Popen(
            self.settings.child_argv(),
            env=env,
            process_group=0,
            stderr=subprocess.PIPE if relayed else None,
        )
        if relayed:
            assert child.proc.stderr is not None
            relay = threading.Thread(
                target=_relay, args=(child.proc.stderr, self.status), daemon=True
            )
            relay.start()
            self.relays.append(relay)
        child.started_at = time.monotonic()
        log.info("poller %d/%d started (pid %d)", child.index, n, child.proc.pid)

    def run(self) -> int:
        n = len(self.children)
        log.info("supervising %d poller processes for %s", n, self.settings.app)
        server = None
        if self.settings.metrics_port is not None:
            self.metrics_dir = tempfile.mkdtemp(prefix="outboxkit-metrics-")
        try:
            if self.metrics_dir is not None:
                server, _ = _serve_metrics(
                    self.outbox, self.settings, multiprocess_dir=self.metrics_dir
                )
            with stop_signals(self.on_signal):
                try:
                    for child in self.children:
                        self._start(child)
                    return self._watch()
                finally:
                    # Never leave children behind, whatever happened here.
                    self._signal_all(signal.SIGKILL)
                    for relay in self.relays:  # their last lines, before ours
                        relay.join(timeout=5)
                    if self.progress is not None:
                        self.progress.finish()  # every child has stopped: the true counts
                    self.status.clear()
        finally:
            if server is not None:
                server.shutdown()
                server.server_close()
            if self.metrics_dir is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _watch(self) -> int:
        n = len(self.children)
        while True:
            now = time.monotonic()
            for child in self.children:
                if child.finished:
                    continue
                if child.proc is None:
                    if self.deadline is not None:
                        child.finished = True
                    elif now >= child.restart_at:
                        child.restarts += 1
                        self._start(child)
                    continue
                code = child.proc.poll()
                if code is None:
                    continue
                pid = child.proc.pid
                child.proc, child.returncode = None, code
                if self.deadline is not None or (self.settings.until_idle and code == 0):
                    child.finished = True
                    continue
                if code == WRONG_INPUT:  # it would fail the same way again: give up
                    self.wrong_input = True
                    self._stop_all(
                        f"poller {child.index}/{n} (pid {pid}) exited with code 2 "
                        "(wrong input, see its log)"
                    )
                    child.finished = True
                    continue
                young = now - child.started_at < self.YOUNG
                child.quick_deaths = child.quick_deaths + 1 if young else 0
                delay = (
                    0.0
                    if child.quick_deaths <= 1
                    else min(0.25 * 2 ** (child.quick_deaths - 2), self.MAX_DELAY)
                )
                child.restart_at = now + delay
                log.warning(
                    "poller %d/%d (pid %d) %s; restarting it%s",
                    child.index,
                    n,
                    pid,
                    _describe_exit(code),
                    f" in {delay:g}s" if delay else "",
                )
            if all(child.finished for child in self.children):
                break
            if self.deadline is not None and now > self.deadline:
                self._signal_all(signal.SIGKILL)
                log.error(
                    "poller processes did not stop within the grace time (%gs): killed them",
                    self.settings.grace.total_seconds(),
                )
                return 1
            if self.progress is not None:
                self.progress.maybe_show()
            self.wake.wait(_TICK)
            self.wake.clear()
        if self.wrong_input:
            return WRONG_INPUT
        clean = (0, -signal.SIGTERM)  # a child stopped before its handlers were in place
        failed = [c for c in self.children if c.returncode not in clean]
        for child in failed:
            log.error("poller %d/%d %s", child.index, n, _describe_exit(child.returncode or 0))
        if not failed:
            log.info("all %d poller processes stopped", n)
        return 1 if failed else 0


def _relay(stream: IO[bytes], status: StatusLine) -> None:
    """Write a child's log lines above the status line, until the child closes its stderr."""
    with stream:
        for line in iter(stream.readline, b""):
            text = line.decode("utf-8", errors="replace")
            status.write(printable(text.rstrip("\n"), newlines=True) + "\n")


def _import_root(app: str) -> str | None:
    """The ``sys.path`` entry the APP's module was imported from, or None."""
    module_name = app.partition(":")[0]
    module = sys.modules.get(module_name)
    filename = getattr(module, "__file__", None)
    if not isinstance(filename, str):
        return None
    root = os.path.dirname(os.path.abspath(filename))
    depth = module_name.count(".") + (os.path.basename(filename) == "__init__.py")
    for _ in range(depth):
        root = os.path.dirname(root)
    return root


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
