"""``PollerBase``: what both pollers are before they differ in how they wait.

The options, the delivery mode checked against the store, a round's bookkeeping and each handler
run's start, the stop flag and the waiter ``stop`` wakes. The pollers themselves are one source:
``outboxkit/aio.py`` (asyncio), from which ``outboxkit/poller.py`` (blocking) is generated.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import datetime

from .bus import HandlerSpec
from .calls import MAX_CONCURRENCY
from .context import Context
from .core.batch import ClaimedBatch
from .core.model import Claim
from .core.options import PollerOptions
from .errors import ConfigurationError
from .runtime import Runtime
from .waiter import Wakeable

__all__ = ["PollerBase"]


class PollerBase:
    """See the module docstring.

    Raises:
        ConfigurationError: ``transaction="per_batch"`` on a store without batches, or with
            ``concurrency`` above 1; ``concurrency`` not from 1 to ``MAX_CONCURRENCY``.
    """

    waiter: Wakeable

    def __init__(self, runtime: Runtime, options: PollerOptions, concurrency: int = 1) -> None:
        self.runtime = runtime
        self.options = options
        self._batched = options.transaction == "per_batch"
        if (
            not isinstance(concurrency, int)
            or isinstance(concurrency, bool)
            or not 1 <= concurrency <= MAX_CONCURRENCY
        ):
            raise ConfigurationError(
                f"concurrency must be an integer from 1 to {MAX_CONCURRENCY:,}, got "
                f"{concurrency!r:.40}"
            )
        if self._batched and concurrency > 1:
            raise ConfigurationError(
                "transaction='per_batch' delivers a batch in one transaction, on one connection: "
                f"it cannot deliver events at once (concurrency={concurrency}); use "
                "transaction='per_event' with concurrency"
            )
        self.concurrency = concurrency
        capabilities = runtime.store.capabilities
        if self._batched and not capabilities.batches:
            raise ConfigurationError(
                f"transaction='per_batch' needs a store with batches; {runtime.store!r} has "
                f"{sorted(capabilities.names())}"
            )
        self._stop = threading.Event()
        # ``prefetch`` where others may claim while a batch or delivery is open; elsewhere a
        # prefetched claim would only wait for the batch's lock (SQLite): it claims as usual.
        self._prefetch = (
            options.prefetch
            and capabilities.concurrent_claimers
            and capabilities.concurrent_batches
        )

    def _claimed(self, claims: Sequence[Claim], claimed_at: datetime) -> ClaimedBatch:
        """The bookkeeping of a round's fresh claims (``Claimed`` emitted for each); what each
        of the round's runs needs from the runtime is read once, here."""
        runtime = self.runtime
        runtime.reporter.refresh()
        runtime.contexts.refresh()
        options = self.options
        batch = ClaimedBatch(
            claims,
            claimed_at=claimed_at,
            lease=options.lease,
            max_retries=options.max_retries,
            backoff=options.backoff,
        )
        runtime.reporter.claimed(claims)
        return batch

    def _begin_run(
        self, claim: Claim, spec: HandlerSpec
    ) -> tuple[Context, datetime, datetime | None, AbstractContextManager[object]]:
        """As one of ``claim``'s handlers starts: its ``ctx``, the instant (the outbox's clock)
        and the local one it started at (for the observers' durations: None when no one
        observes), ``HandlerStarted`` emitted, and what the handler scope plugins wrap its run
        in."""
        runtime = self.runtime
        attempt = claim.event.attempts
        ctx = runtime.contexts.make(spec.name, attempt)
        at, began = runtime.reporter.started(claim, spec)
        scope = runtime.reporter.scope(claim.event, spec, attempt, self._batched)
        return ctx, at, began, scope

    def __repr__(self) -> str:
        o = self.options
        return (
            f"{type(self).__name__}(batch_size={o.batch_size}, "
            f"lease={o.lease.total_seconds()}s, interval={o.interval.total_seconds()}s, "
            f"max_retries={o.max_retries}, transaction={o.transaction!r}"
            f"{', prefetch=True' if o.prefetch else ''}{self._described()})"
        )

    def _described(self) -> str:
        return f", concurrency={self.concurrency}" if self.concurrency > 1 else ""

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Stop gracefully: finish the events in hand, release the leases of the rest (safe
        from any thread and from a signal handler)."""
        self._stop.set()
        self.waiter.wake()
