"""The outbox a command works on: an app's (``--app``, ``outboxkit run APP``), a store URL's
(``--store``, ``OUTBOXKIT_STORE``), or the app's rebound to the store URL.

A store URL and its options may come from the environment instead of the command line, where
any user could read them (a URL may hold a password): ``OUTBOXKIT_STORE`` and
``OUTBOXKIT_STORE_OPTIONS``, a JSON object.

The ops commands open a store without creating or migrating anything (``existing=True``): a
SQLite store opens with ``create=False, migrate=False``, so a mistyped path is an error, not a
new empty database (``run`` opens it with ``create=False``: the same error, and an existing
database is migrated as the store does on open), and only ``outboxkit migrate`` changes a
schema (a PostgreSQL store never creates or migrates on open). ``migrate`` opens it with
``migrate=False`` itself, so that its own ``migrate()`` reports what it did.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from ..core.text import redact_url
from ..errors import ConfigurationError
from ..outbox import Outbox
from ..plugins import open_store
from ..store import Store
from .apps import LoadError, load_object
from .errors import InputError
from .params import StoreOption

__all__ = ["STORE_ENV", "STORE_OPTIONS_ENV", "load_app", "open_outbox", "with_store_options"]

STORE_ENV = "OUTBOXKIT_STORE"
"""The environment variable naming the store URL when ``--store`` is not given."""
STORE_OPTIONS_ENV = "OUTBOXKIT_STORE_OPTIONS"
"""The environment variable holding store options as a JSON object, when no ``-o`` is given
(how ``run --processes`` hands its children the store without putting it on a command line)."""

F = TypeVar("F", bound=Callable[..., Any])


def load_app(spec: str) -> Outbox:
    """The ``Outbox`` that ``module:attribute`` names; the working directory is importable.

    Args:
        spec: ``module:attribute``, e.g. ``myapp.events:outbox``.

    Returns:
        The app's own outbox (not a copy).

    Raises:
        InputError: the spec is malformed, the module does not import, the attribute is
            missing or not an ``Outbox``.
    """
    try:
        outbox: Outbox = load_object(spec, what="APP", kind=Outbox)
    except LoadError as exc:
        raise InputError(str(exc)) from None
    return outbox


# Per URL scheme: the options that keep a store from creating (or migrating) on open.
_NO_CREATE: dict[str, dict[str, Any]] = {"sqlite": {"create": False, "migrate": False}}
_NO_MIGRATE: dict[str, dict[str, Any]] = {"sqlite": {"migrate": False}}
_MUST_EXIST: dict[str, dict[str, Any]] = {"sqlite": {"create": False}}


@contextmanager
def open_outbox(
    *,
    app: str | None,
    store_url: str | None,
    store_options: Sequence[tuple[str, Any]],
    existing: bool = False,
    migrating: bool = False,
    must_exist: bool = False,
) -> Iterator[Outbox]:
    """The outbox an ops command works on: the APP's, rebound to ``store_url`` if one is
    given (``--store`` or ``OUTBOXKIT_STORE``), or a plain one on ``store_url``. A store opened
    here is closed at the end.

    Args:
        app: ``module:attribute`` naming the app's outbox, or None.
        store_url: the store's URL, or None for the app's own store.
        store_options: ``(key, value)`` pairs for the store; none given reads
            ``OUTBOXKIT_STORE_OPTIONS``.
        existing: the database must exist, and is neither created nor migrated on open.
        migrating: the store is not migrated on open (the command migrates it).
        must_exist: the database must exist (it may be migrated on open, as the store does by
            default): ``run``, which must not make a new database of a mistyped path.

    Yields:
        The outbox.

    Raises:
        InputError: neither is given, or either is wrong.
    """
    options = dict(store_options) or _options_from_env()
    if options and not store_url:
        raise InputError("--store-option needs --store URL (or OUTBOXKIT_STORE)")
    if app is None and not store_url:
        raise InputError(
            f"no store: pass --store URL, set {STORE_ENV}, or pass --app module:attribute"
        )
    outbox = load_app(app) if app is not None else None
    if store_url and (existing or migrating or must_exist):
        scheme = store_url.split("://", 1)[0].split("+", 1)[0].lower()
        table = _NO_CREATE if existing else _NO_MIGRATE if migrating else _MUST_EXIST
        options = {**options, **table.get(scheme, {})}
    store = _open_store(store_url, options) if store_url else None
    try:
        if store is None:
            assert outbox is not None
            yield outbox
        elif outbox is None:
            yield Outbox(store)
        else:
            yield outbox.rebind(store=store)
    finally:
        if store is not None:
            store.close()


def _open_store(url: str, options: Mapping[str, Any]) -> Store:
    try:
        store: Store = open_store(url, **options)
    except ConfigurationError as exc:
        raise InputError(f"store {redact_url(url)!r}: {exc}") from None
    return store


def _options_from_env() -> dict[str, Any]:
    raw = os.environ.get(STORE_OPTIONS_ENV)
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise InputError(f"{STORE_OPTIONS_ENV} must hold a JSON object of store options")
    return options


def with_store_options(fn: F) -> F:
    """``--store``, ``--store-option`` and ``--app``, for the ops commands."""
    fn = click.option(
        "--app",
        "app",
        metavar="APP",
        default=None,
        help="module:attribute naming your Outbox (its store, unless --store is given).",
    )(fn)
    fn = click.option(
        "-o",
        "--store-option",
        "store_options",
        type=StoreOption(),
        multiple=True,
        help="An option for the store, e.g. -o schema=outbox (repeatable).",
    )(fn)
    fn = click.option(
        "--store",
        "store_url",
        envvar=STORE_ENV,
        show_envvar=True,
        metavar="URL",
        default=None,
        help="The store URL: sqlite:///app.db, postgresql://user@host/db, ...",
    )(fn)
    return fn
