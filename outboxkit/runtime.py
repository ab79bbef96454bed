"""``Runtime``: what a poller needs from its outbox, and nothing more.

A poller takes a ``Runtime`` (``Outbox.runtime()`` makes one), not the ``Outbox``: the store,
the subscriptions, the clocks, the contexts its handlers get, the reporter, the dead-key policy,
where to register its waiter and the retention it runs between rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from .core.model import DeadKey

if TYPE_CHECKING:
    from .bus import EventBus
    from .clock import Clock
    from .context import ContextMaker
    from .reports import Reporter
    from .store import Store
    from .waiter import Wakeable

__all__ = ["Runtime"]


@dataclass(frozen=True, slots=True)
class Runtime:
    """What a poller needs from its outbox (see the module docstring).

    Attributes:
        store: where the events live.
        bus: the subscriptions (read: handler names by topic, the specs).
        clock: the outbox's clock (the instants of reports, and of store calls in tests).
        local_clock: the poller's own deadlines' clock (monotonic in production).
        store_now: the instant to bind into a store call (None: the store's own clock).
        dead_key: the outbox's dead-key policy (R15), for the claims.
        contexts: makes each handler run's ``ctx``.
        reporter: reports runs, settlements and lost leases.
        add_waiter, remove_waiter: register the waiter an in-process enqueue wakes.
        prune_if_due: the outbox's retention, run between rounds of a poller that runs forever.
    """

    store: Store
    bus: EventBus
    clock: Clock
    local_clock: Clock
    store_now: Callable[[], datetime | None]
    dead_key: DeadKey
    contexts: ContextMaker
    reporter: Reporter
    add_waiter: Callable[[Wakeable], None]
    remove_waiter: Callable[[Wakeable], None]
    prune_if_due: Callable[[], object]
