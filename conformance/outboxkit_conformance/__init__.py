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
cleanup. Tests needing a capability the store does not declare are skipped with the reason;
``known_failures`` (on the subclass, or an attribute of the factory) maps test names to reasons
and runs those tests as strict xfail.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ._base import Recorder, StoreFactory, call_factory
from ._lifecycle_tests import LifecycleTests
from ._store_tests import StoreLevelTests

__all__ = [
    "SUITE_VERSION",
    "Recorder",
    "StoreConformance",
    "StoreFactory",
    "call_factory",
    "load_factory",
]

SUITE_VERSION = "1.0.0"


class StoreConformance(StoreLevelTests, LifecycleTests):
    """Every conformance test. Subclass it as ``Test...`` and implement ``make_store(tmp_path)``."""


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``module:attribute`` and return the store factory it names.

    Raises:
        ValueError: the spec is malformed, does not import, or does not name a callable.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"a store factory is given as 'module:attribute', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"cannot import {module_name!r} for store factory {spec!r}: {exc}"
        ) from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attribute!r}") from None
    if not callable(target):
        raise ValueError(f"store factory {spec!r} is not callable: {target!r}")
    return target  # type: ignore[no-any-return]
