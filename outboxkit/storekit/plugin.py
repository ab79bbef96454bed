"""What a store package's plugin module needs: the store's class, imported on first use.

The ``outboxkit`` entry point loads every store package's plugin in every process that opens
a store, so a plugin imports no driver: it registers ``StoreClass(...).open``, and the store's
module (and with it the driver) is imported when a store is opened. A driver that is not
installed is then ``MissingDependency``, naming the extra that installs it::

    MYSTORE = StoreClass("mystore.store", "MyStore", drivers=("mydriver",),
                         needs="mydriver", extra="mystore", what="the MyDB store")

    @hookimpl
    def outboxkit_register_stores(register: RegisterStore) -> None:
        register("mydb", MYSTORE.open, schemes=("mydb",))
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any

from ..errors import MissingDependency

__all__ = ["StoreClass"]


class StoreClass:
    """The store class ``name`` of ``module``, imported on first use (see the module
    docstring).

    Args:
        module: the module the class is in.
        name: the class's name in it.
        drivers: the top-level modules of its driver(s): an ``ImportError`` of one of them is
            ``MissingDependency``; any other propagates as it is.
        needs: what to install, for the message (``"PyMySQL"``).
        extra: the ``outboxkit[extra]`` that installs it.
        what: the store, for the message (``"the MySQL store"``).
    """

    __slots__ = ("drivers", "extra", "module", "name", "needs", "what")

    def __init__(
        self, module: str, name: str, *, drivers: Collection[str], needs: str, extra: str, what: str
    ) -> None:
        self.module = module
        self.name = name
        self.drivers = frozenset(drivers)
        self.needs = needs
        self.extra = extra
        self.what = what

    def load(self) -> Any:
        """The class, its module imported now if it is not yet.

        Raises:
            MissingDependency: a driver is not installed.
        """
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] not in self.drivers:
                raise
            raise MissingDependency(
                f"{self.what} needs {self.needs} ({exc.name} is missing): "
                f"install outboxkit[{self.extra}]"
            ) from exc
        return getattr(module, self.name)

    def open(self, url: str, **options: Any) -> Any:
        """``open_store(url, **options)`` for this store: the class's ``from_url``.

        Raises:
            MissingDependency: a driver is not installed.
            ConfigurationError: a bad URL or option.
        """
        return self.load().from_url(url, **options)
