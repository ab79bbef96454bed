"""The ``OUTBOXKIT`` setting: which database alias the outbox lives in, which outbox the
``manage.py outboxkit`` command runs, and the store's options.

.. code-block:: python

    OUTBOXKIT = {
        "DATABASE": "default",             # the alias in DATABASES (default: "default")
        "OUTBOX": "myapp.events:outbox",   # module:attribute naming the app's Outbox
        "STORE_OPTIONS": {},               # e.g. {"table_prefix": "outbox_"}, {"schema": "outbox"}
    }
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from outboxkit.errors import ConfigurationError

__all__ = ["Config", "config"]

_KEYS = frozenset({"DATABASE", "OUTBOX", "STORE_OPTIONS"})


@dataclass(frozen=True)
class Config:
    database: str = "default"
    outbox: str | None = None
    store_options: dict[str, Any] = field(default_factory=dict)


def config() -> Config:
    """The ``OUTBOXKIT`` setting, checked.

    Raises:
        ConfigurationError: it is not a dict, has an unknown key, or a value of the wrong type
            (the message names it); ``DATABASE`` is not an alias of ``DATABASES``.
    """
    from django.conf import settings

    raw = getattr(settings, "OUTBOXKIT", {})
    if not isinstance(raw, dict):
        raise ConfigurationError(f"settings.OUTBOXKIT must be a dict, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        raise ConfigurationError(
            f"settings.OUTBOXKIT has unknown key(s) {unknown}; the keys are {sorted(_KEYS)}"
        )
    database = raw.get("DATABASE", "default")
    if not isinstance(database, str) or database not in settings.DATABASES:
        raise ConfigurationError(
            f"settings.OUTBOXKIT['DATABASE'] must name an alias of settings.DATABASES "
            f"({sorted(settings.DATABASES)}), got {database!r}"
        )
    outbox = raw.get("OUTBOX")
    if outbox is not None and (not isinstance(outbox, str) or ":" not in outbox):
        raise ConfigurationError(
            "settings.OUTBOXKIT['OUTBOX'] must be 'module:attribute' naming the app's Outbox, "
            f"got {outbox!r}"
        )
    options = raw.get("STORE_OPTIONS", {})
    if not isinstance(options, dict):
        raise ConfigurationError(
            f"settings.OUTBOXKIT['STORE_OPTIONS'] must be a dict, got {type(options).__name__}"
        )
    return Config(database=database, outbox=outbox, store_options=dict(options))
