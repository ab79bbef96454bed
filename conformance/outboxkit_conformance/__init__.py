"""The outboxkit store conformance suite (import name ``outboxkit_conformance``).

Every store - memory, SQLite, Postgres, and yours - must pass the same checks. Two ways to run it:

One command, against a factory that returns a fresh, empty, migrated store::

    outboxkit conformance mypkg.stores:make_store [-k claim -x ...]
    pytest --pyargs outboxkit_conformance --outbox-store-factory=mypkg.stores:make_store

Or subclass the base class in your own tests (fsspec / dbapi20 style)::

    from outboxkit_conformance import StoreConformance

    class TestMyStore(StoreConformance):
        def make_store(self, tmp_path):
            return MyStore(tmp_path / "db")

The factory (or ``make_store``) may return a context manager yielding the store when it needs
cleanup. Tests needing a capability the store does not declare (a field of
``outboxkit.storekit.Capabilities``) are skipped, the skip naming the capability and why the
check needs it; ``known_failures`` (on the subclass, or an attribute of the factory) maps test
names to reasons and runs those tests as strict xfail.

The checks that go through an ``Outbox`` run in every delivery mode (``_modes``): the blocking
poller per event and per batch, and the asyncio poller per event, per batch and four events at
once, from the same test code; a store without an asyncio side (``capabilities.asyncio`` false)
skips the asyncio modes with the reason. Since 1.4.0 the asyncio poller awaits ``tx.open()``
(``AsyncDeliveryTransaction.open``) before it calls a transactional handler: an asyncio side
written for 1.3 adds it (a no-op where its deliveries open at once).

The tests are split by concern, one mixin per module, which ``StoreConformance`` composes:
``EnqueueTests`` (``_enqueue``), ``ClaimTests`` (``_claim``), ``DeliveryTests`` (``_delivery``),
``SettleTests`` (``_settle``), ``BatchTests`` (``_batch``), ``OperationsTests``
(``_operations``), ``TimeTests`` (``_time``), ``TextTests`` (``_text``), ``ConcurrencyTests``
(``_concurrency``), ``LifecycleTests`` (``_lifecycle``) and, since 1.4.0, ``OrderingTests``
(``_ordering``: per-key order, ``dead_key``; ``Store.claim`` takes ``dead_key``) and, since
1.9.0, ``DedupeTests`` (``_dedupe``). A store still in the making may subclass a few of them
instead.

Since 1.5.0 ``LifecycleTests`` checks a relay end to end (one publish per batch in every mode,
each confirm recorded once, the unconfirmed retried alone), through ``record_many`` (a relay's
confirms recorded together; ``outboxkit.storekit``'s default: one ``delivery`` per confirm).

Since 1.6.0 ``LifecycleTests`` checks the pollers' ``prefetch`` on a store that declares
``concurrent_claimers`` and ``concurrent_batches``: the next batch claimed while one is
delivered, every event still run and recorded once, and a stopping poller releasing the batch
it claimed ahead. A store that declares those capabilities must let a claim run while another
thread's batch or delivery is open.

Since 1.7.0 ``BatchTests`` checks a batch's settlement as its last write, which both pollers
make it in ``per_batch`` mode (the batch's ``settle_last``; ``outboxkit.storekit.BatchBase``'s
default is ``settle_many``): fenced by token and committed with everything else the batch wrote.

Since 1.8.0 ``EnqueueTests`` checks an event's message identity (``Event.message_id``, what a
relay sends as the message's id): drawn by the store when the event is written, unique across
two stores (``make_store`` is called a second time, on another directory, for a second fresh
store), the same on every read. A store that leaves it unset gives every event its decimal id,
which two stores share, and fails the check.

Since 1.9.0 per-key order and dedupe keys are capabilities (``Capabilities.ordering``,
``Capabilities.dedupe``), as the store seam ``outboxkit.storekit`` has them: ``OrderingTests``
(R15, ``dead_key``) needs ``ordering`` and the new ``DedupeTests`` (R16, split off
``OrderingTests``) needs ``dedupe``; a store that does not declare them skips those checks, and
the enqueue checks write a ``key`` only on a store with ``ordering``. The ``available_at``
check moved from ``OrderingTests`` to ``TimeTests`` (it needs no capability). Every skip names
the capability and why the check needs it. The suite calls ``batch.settle_last`` directly
(every batch has it: ``BatchTransaction``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from outboxkit.testing.recorder import Recorder

from ._base import ConformanceBase, StoreFactory, call_factory
from ._batch import BatchTests
from ._claim import ClaimTests
from ._concurrency import ConcurrencyTests
from ._dedupe import DedupeTests
from ._delivery import DeliveryTests
from ._enqueue import EnqueueTests
from ._lifecycle import LifecycleTests
from ._operations import OperationsTests
from ._ordering import OrderingTests
from ._settle import SettleTests
from ._text import TextTests
from ._time import TimeTests

__all__ = [
    "SUITE_VERSION",
    "BatchTests",
    "ClaimTests",
    "ConcurrencyTests",
    "ConformanceBase",
    "DedupeTests",
    "DeliveryTests",
    "EnqueueTests",
    "LifecycleTests",
    "OperationsTests",
    "OrderingTests",
    "Recorder",
    "SettleTests",
    "StoreConformance",
    "StoreFactory",
    "TextTests",
    "TimeTests",
    "call_factory",
    "load_factory",
]

SUITE_VERSION = "1.11.0"


class StoreConformance(
    EnqueueTests,
    ClaimTests,
    DeliveryTests,
    SettleTests,
    BatchTests,
    OperationsTests,
    TimeTests,
    TextTests,
    ConcurrencyTests,
    LifecycleTests,
    OrderingTests,
    DedupeTests,
):
    """Every conformance test. Subclass it as ``Test...`` and implement ``make_store(tmp_path)``."""


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``module:attribute`` and return the store factory it names.

    Raises:
        ValueError: the spec is malformed, does not import, or does not name a callable (an
            ``outboxkit.cli.apps.LoadError``, which is a ``ConfigurationError``).
    """
    # Imported here: the loader lives in the CLI package, which importing the suite does not need.
    from outboxkit.cli.apps import load_object

    factory: Callable[..., Any] = load_object(
        spec, what="store factory", kind=callable, example="mypkg.stores:make_store"
    )
    return factory
