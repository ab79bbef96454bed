"""OpenTelemetry tracing for outboxkit (``pip install "outboxkit[otel]"``).

Register :class:`Tracing` on an outbox (``Outbox(..., plugins=[Tracing()])`` or
``outbox.add_observer(Tracing())``):

- ``enqueue`` (and a handler's ``ctx.enqueue``) stores the current span's context with the
  event, in its headers under the W3C keys ``traceparent`` and ``tracestate``, when a span is
  active. A ``traceparent`` the caller gives in ``headers=`` wins (none of the two is added).
- every handler's run is a span of kind CONSUMER named ``process <topic>``, with the messaging
  semantic conventions' attributes (``messaging.system`` = ``outboxkit``,
  ``messaging.destination.name`` = the topic, ``messaging.message.id`` = the event's id,
  ``messaging.operation.type`` = ``process``, ``messaging.consumer.group.name`` = the handler)
  and ``outboxkit.attempt``. Its parent is the context stored at enqueue; in a batch
  (``transaction="per_batch"``) the stored context is a link instead, since one transaction
  then serves many events' traces. A failure sets the span's status to ERROR and records the
  exception; a ``Reject`` adds a ``rejected`` span event. The span is current while the
  handler runs: its follow-ups carry it, and so are the handler's own spans its children.

Both pollers (blocking and asyncio) use it alike. Nothing of OpenTelemetry is imported until a
``Tracing`` is made.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ..core.model import Event
from ..core.text import describe_exception
from ..errors import MissingDependency, Reject
from ..hookspecs import hookimpl

__all__ = ["TRACE_HEADERS", "Tracing"]

TRACE_HEADERS = ("traceparent", "tracestate")
"""The headers the trace context is stored under (W3C Trace Context)."""


def _opentelemetry() -> Any:
    try:
        from opentelemetry import trace
    except ImportError as exc:
        raise MissingDependency(
            'tracing needs the OpenTelemetry API: pip install "outboxkit[otel]"'
        ) from exc
    return trace


class Tracing:
    """The tracing plugin (see the module's docstring).

    Args:
        tracer_provider: where spans go (default: the global one, ``trace.get_tracer_provider()``).

    Raises:
        MissingDependency: ``opentelemetry-api`` is not installed.
    """

    def __init__(self, tracer_provider: Any = None) -> None:
        trace = _opentelemetry()
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from .. import __version__

        self._trace = trace
        self._tracer = trace.get_tracer("outboxkit", __version__, tracer_provider=tracer_provider)
        # W3C only, whatever the app's global propagator: the two headers are the contract
        # relays and other consumers read.
        self._propagator = TraceContextTextMapPropagator()

    def __repr__(self) -> str:
        return "Tracing()"

    @hookimpl
    def outboxkit_enqueue_headers(
        self, topic: str, headers: Mapping[str, str]
    ) -> Mapping[str, str] | None:
        """The current span's context as ``traceparent``/``tracestate``, unless the caller
        gave a ``traceparent`` or no span is active."""
        if "traceparent" in headers:
            return None
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        return {k: v for k, v in carrier.items() if k in TRACE_HEADERS} or None

    @hookimpl
    def outboxkit_handler_scope(
        self, event: Event, handler: str, attempt: int, batched: bool
    ) -> AbstractContextManager[object]:
        """The delivery's span, current while the handler runs."""
        return self._span(event, handler, attempt, batched)

    @contextmanager
    def _span(self, event: Event, handler: str, attempt: int, batched: bool) -> Iterator[object]:
        from opentelemetry.context import Context
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode

        trace = self._trace
        stored = self._propagator.extract(
            {k: v for k, v in event.headers.items() if k in TRACE_HEADERS}
        )
        origin = trace.get_current_span(stored).get_span_context()
        links = []
        if batched:
            # The span's parent is what is current (nothing, under outboxkit's pollers); the
            # enqueue's context is a link.
            parent = None
            if origin.is_valid:
                links.append(Link(origin))
        else:
            # Never the poller's own context: an event without a stored one starts a trace.
            parent = stored if origin.is_valid else Context()
        with self._tracer.start_as_current_span(
            f"process {event.topic}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes={
                "messaging.system": "outboxkit",
                "messaging.destination.name": event.topic,
                "messaging.message.id": str(event.id),
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.consumer.group.name": handler,
                "outboxkit.attempt": attempt,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except Reject as rejection:
                span.add_event("rejected", {"reason": str(rejection.reason)})
                raise
            except BaseException as exc:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, describe_exception(exc)))
                raise
