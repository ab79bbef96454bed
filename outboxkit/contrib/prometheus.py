"""Prometheus metrics for outboxkit (``pip install "outboxkit[prometheus]"``).

:class:`Metrics` is an observer: it counts what the pollers do. :class:`StoreCollector` reads
the store's gauges when it is scraped. ``outboxkit run --metrics-port N`` serves both for the
whole supervised group (see ``outboxkit.cli.runner``); an app serving its own ``/metrics``
registers them itself::

    outbox.add_observer(Metrics())                    # on prometheus_client's default registry
    prometheus_client.REGISTRY.register(StoreCollector(outbox))

From the observer events (per process; summed over the processes of ``outboxkit run``):

- ``outboxkit_deliveries_total{topic, handler, outcome}``: handler runs, ``outcome`` one of
  ``succeeded``, ``rejected``, ``failed``;
- ``outboxkit_handler_duration_seconds{topic, handler}``: how long a run took, its record
  included (histogram);
- ``outboxkit_lag_seconds{topic}``: from the event's enqueue (``created_at``, by the store's
  clock) to the start of a handler's run (histogram);
- ``outboxkit_claim_batch_size``: events per claim that took any (histogram);
- ``outboxkit_published_total{topic}``, ``outboxkit_retries_total{topic}``,
  ``outboxkit_dead_letters_total{topic}``, ``outboxkit_lease_losses_total{topic}``.

From the store, at scrape time (``StoreCollector``):

- ``outboxkit_pending_events``: the backlog (neither published nor dead, not leased);
- ``outboxkit_in_flight_events``: leased by a poller now;
- ``outboxkit_dead_letter_events``: dead letters waiting for an operator;
- ``outboxkit_oldest_due_age_seconds``: how long the oldest due event has waited (0: none);
- ``outboxkit_store_up``: 1, or 0 when the store could not be asked (the others are then absent).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..core.model import (
    Claimed,
    DeadLettered,
    HandlerFailed,
    HandlerRejected,
    HandlerStarted,
    HandlerSucceeded,
    LeaseLost,
    ObserverEvent,
    Published,
    RetryScheduled,
)
from ..errors import MissingDependency
from ..hookspecs import hookimpl

if TYPE_CHECKING:
    from ..outbox import Outbox

__all__ = ["BATCH_BUCKETS", "Metrics", "StoreCollector"]

log = logging.getLogger("outboxkit")

BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
"""The claim batch size histogram's buckets (``batch_size`` defaults to 100)."""

_LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise MissingDependency(
            'metrics need prometheus_client: pip install "outboxkit[prometheus]"'
        ) from exc
    return prometheus_client


class Metrics:
    """The observer that keeps outboxkit's counters and histograms (see the module docstring).

    Args:
        registry: where the metrics are registered (default: prometheus_client's ``REGISTRY``).
            One ``Metrics`` per registry: the names are registered once.

    Raises:
        MissingDependency: prometheus_client is not installed.
    """

    def __init__(self, registry: Any = None) -> None:
        prometheus = _prometheus()
        if registry is None:
            registry = prometheus.REGISTRY
        Counter, Histogram = prometheus.Counter, prometheus.Histogram
        self.deliveries = Counter(
            "outboxkit_deliveries",
            "Handler runs, by topic, handler and outcome.",
            ["topic", "handler", "outcome"],
            registry=registry,
        )
        self.handler_duration = Histogram(
            "outboxkit_handler_duration_seconds",
            "How long a handler's run took, its delivery record included.",
            ["topic", "handler"],
            registry=registry,
        )
        self.lag = Histogram(
            "outboxkit_lag_seconds",
            "From an event's enqueue to the start of a handler's run.",
            ["topic"],
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        self.claim_batch_size = Histogram(
            "outboxkit_claim_batch_size",
            "Events taken by one claim (claims that took any).",
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.published = Counter(
            "outboxkit_published", "Events published.", ["topic"], registry=registry
        )
        self.retries = Counter(
            "outboxkit_retries", "Events scheduled for a retry.", ["topic"], registry=registry
        )
        self.dead_letters = Counter(
            "outboxkit_dead_letters", "Events dead-lettered.", ["topic"], registry=registry
        )
        self.lease_losses = Counter(
            "outboxkit_lease_losses",
            "Events whose lease this poller lost (another may own them).",
            ["topic"],
            registry=registry,
        )

    def __repr__(self) -> str:
        return "Metrics()"

    @hookimpl
    def outboxkit_on_event(self, event: ObserverEvent) -> None:
        """Count ``event``."""
        if isinstance(event, HandlerSucceeded | HandlerRejected | HandlerFailed):
            outcome = (
                "succeeded"
                if isinstance(event, HandlerSucceeded)
                else "rejected"
                if isinstance(event, HandlerRejected)
                else "failed"
            )
            self.deliveries.labels(event.topic, event.handler, outcome).inc()
            if event.duration is not None:
                self.handler_duration.labels(event.topic, event.handler).observe(
                    max(event.duration.total_seconds(), 0.0)
                )
        elif isinstance(event, HandlerStarted):
            if event.created_at is not None and event.started_at is not None:
                lag = (event.started_at - event.created_at).total_seconds()
                self.lag.labels(event.topic).observe(max(lag, 0.0))
        elif isinstance(event, Claimed):
            if event.position == 0:
                self.claim_batch_size.observe(event.batch_size)
        elif isinstance(event, Published):
            self.published.labels(event.topic).inc()
        elif isinstance(event, RetryScheduled):
            self.retries.labels(event.topic).inc()
        elif isinstance(event, DeadLettered):
            self.dead_letters.labels(event.topic).inc()
        elif isinstance(event, LeaseLost):
            self.lease_losses.labels(event.topic).inc()


class StoreCollector:
    """A prometheus_client collector of the store's gauges, read with ``outbox.stats()`` at
    every scrape (see the module docstring). A store that cannot be asked gives
    ``outboxkit_store_up 0`` and is logged, never raised into the scrape.

    Args:
        outbox: whose store to read.

    Raises:
        MissingDependency: prometheus_client is not installed.
    """

    def __init__(self, outbox: Outbox) -> None:
        _prometheus()
        from prometheus_client.core import GaugeMetricFamily

        self._gauge = GaugeMetricFamily
        self.outbox = outbox

    def __repr__(self) -> str:
        return f"StoreCollector({self.outbox.store!r})"

    def describe(self) -> list[Any]:
        """Nothing: registering it must not ask the store."""
        return []

    def collect(self) -> Iterator[Any]:
        """The gauges, read now."""
        gauge = self._gauge
        try:
            stats = self.outbox.stats()
            now: datetime | None = self.outbox.now() if stats.oldest_due_at else None
        except Exception as exc:
            log.warning("metrics: the store could not be asked for its counts: %s", exc)
            yield gauge("outboxkit_store_up", "Whether the store answered the scrape.", value=0)
            return
        yield gauge("outboxkit_store_up", "Whether the store answered the scrape.", value=1)
        yield gauge(
            "outboxkit_pending_events",
            "Events neither published nor dead, and not leased: the backlog.",
            value=stats.pending,
        )
        yield gauge(
            "outboxkit_in_flight_events", "Events leased by a poller now.", value=stats.claimed
        )
        yield gauge("outboxkit_dead_letter_events", "Dead-lettered events.", value=stats.dead)
        yield gauge(
            "outboxkit_held_keys",
            "Keys with a dead event (held, their later events waiting, under dead_key='hold').",
            value=stats.held_keys,
        )
        age = 0.0
        if stats.oldest_due_at is not None and now is not None:
            age = max((now - stats.oldest_due_at).total_seconds(), 0.0)
        yield gauge(
            "outboxkit_oldest_due_age_seconds",
            "How long the oldest due event has waited (0: none is due).",
            value=age,
        )


def serve(
    outbox: Outbox, port: int, *, host: str = "127.0.0.1", multiprocess_dir: str | None = None
) -> Any:
    """Serve ``/metrics`` on ``host:port`` in a daemon thread: the store's gauges, and either
    this process's :class:`Metrics` (returned, to register on the outbox) or, with
    ``multiprocess_dir``, the sum of what the processes writing there counted (prometheus_client's
    multiprocess mode; the caller's own process then counts nothing itself).

    Returns:
        ``(server, metrics)``: call ``server.shutdown()`` to stop; ``metrics`` is None with
        ``multiprocess_dir``.

    Raises:
        MissingDependency: prometheus_client is not installed.
        OSError: the port cannot be bound.
    """
    prometheus = _prometheus()
    registry = prometheus.CollectorRegistry()
    metrics: Metrics | None = None
    if multiprocess_dir is None:
        metrics = Metrics(registry)
    else:
        from prometheus_client import multiprocess

        collector: Any = multiprocess.MultiProcessCollector  # untyped in prometheus_client
        collector(registry, path=multiprocess_dir)
    registry.register(StoreCollector(outbox))
    server, _thread = prometheus.start_http_server(port, addr=host, registry=registry)
    return server, metrics
