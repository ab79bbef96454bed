"""Names and options every SQL store checks the same way, before anything connects."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from ..errors import ConfigurationError

__all__ = [
    "IDENTIFIER",
    "check_bool",
    "check_count",
    "check_options",
    "check_seconds",
    "table_names",
    "validate_identifier",
    "validate_table_names",
]

IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}\Z")


def validate_identifier(value: object, what: str) -> str:
    """``value`` if it is a safe SQL identifier (``^[A-Za-z_][A-Za-z0-9_]{0,62}$``).

    Raises:
        ConfigurationError: naming ``what`` and the bad value (shortened).
    """
    if not isinstance(value, str) or not IDENTIFIER.match(value):
        raise ConfigurationError(
            f"{what} must match ^[A-Za-z_][A-Za-z0-9_]{{0,62}}$, got {value!r:.80}"
        )
    return value


def table_names(
    prefix: object, events: object, deliveries: object, schema_table: object
) -> tuple[str, str, str]:
    """The store's three tables: ``{prefix}events``, ``{prefix}deliveries``, ``{prefix}schema``,
    each replaced by its own option when given (``events_table`` ...), validated.

    Raises:
        ConfigurationError: the prefix or a name is not a string or makes an unsafe name.
    """
    if not isinstance(prefix, str):
        validate_identifier(prefix, "table_prefix")  # raises, naming the option
    defaults = (f"{prefix}events", f"{prefix}deliveries", f"{prefix}schema")
    for name, given in zip(defaults, (events, deliveries, schema_table), strict=True):
        if given is None:
            validate_identifier(name, "table_prefix")
    chosen = [
        default if given is None else given
        for default, given in zip(defaults, (events, deliveries, schema_table), strict=True)
    ]
    return (
        validate_identifier(chosen[0], "events_table"),
        validate_identifier(chosen[1], "deliveries_table"),
        validate_identifier(chosen[2], "schema_table"),
    )


def validate_table_names(
    events: str,
    deliveries: str,
    schema_table: str,
    *,
    derived: Callable[[str, str], Iterable[str]] | None = None,
    ignore_case: bool = False,
) -> None:
    """The three table names: all different, and none named like an object the store derives
    from a table's name.

    Args:
        derived: the names of the objects (indexes, sequences...) the store derives from a
            table, as ``derived(option, table)`` with ``option`` one of ``events_table``,
            ``deliveries_table``, ``schema_table``.
        ignore_case: compare names ignoring (ASCII) case, as SQLite does.

    Raises:
        ConfigurationError: naming the bad option and value, or the clash.
    """
    tables = {
        "events_table": validate_identifier(events, "events_table"),
        "deliveries_table": validate_identifier(deliveries, "deliveries_table"),
        "schema_table": validate_identifier(schema_table, "schema_table"),
    }

    def key(name: str) -> str:
        return name.lower() if ignore_case else name

    if len({key(name) for name in tables.values()}) != 3:
        raise ConfigurationError(
            "events_table, deliveries_table and schema_table must differ"
            f"{' ignoring case' if ignore_case else ''}, got {events!r}, {deliveries!r}, "
            f"{schema_table!r}"
        )
    if derived is None:
        return
    own = {
        key(name): (source, table, name)
        for source, table in tables.items()
        for name in derived(source, table)
    }
    for option, table in tables.items():
        if key(table) in own:
            source, base, name = own[key(table)]
            raise ConfigurationError(
                f"{option} must not be named like the store's own {name!r}, derived from "
                f"{source} {base!r}, got {table!r}"
            )


def check_options(options: Mapping[str, Any], known: Collection[str], *, store: str) -> None:
    """Refuse options a store does not know (``open_store(url, **options)``).

    Raises:
        ConfigurationError: naming the unknown ones and the known ones.
    """
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigurationError(
            f"unknown {store} store option(s) {unknown}; known: {sorted(known)}"
        )


def check_bool(name: str, value: object) -> bool:
    """Raises ConfigurationError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r:.40}")
    return value


def check_count(name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    """Raises ConfigurationError unless ``value`` is an integer in ``[minimum, maximum]``."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum:,}"
        raise ConfigurationError(f"{name} must be an integer {bound}, got {value!r:.40}")
    return value


def check_seconds(name: str, value: object, *, allow_zero: bool) -> float:
    """Raises ConfigurationError unless ``value`` is a finite number of seconds, > 0 (or >= 0
    with ``allow_zero``)."""
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigurationError(
            f"{name} must be a finite number of seconds {bound}, got {value!r:.40}"
        )
    return float(value)
