"""Plugin managers and the store registry. One manager per ``Outbox``; no module-level state."""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from . import hookspecs
from .core.model import ObserverEvent
from .core.text import redact_url, scrub, secrets_of
from .errors import ConfigurationError, UnknownStore, chain

__all__ = [
    "StoreEntry",
    "make_plugin_manager",
    "notify",
    "open_store",
    "register",
    "registered_stores",
]

log = logging.getLogger("outboxkit")


def make_plugin_manager(
    plugins: Iterable[object] = (), *, load_entry_points: bool = True, stores: bool = True
) -> pluggy.PluginManager:
    """A fresh plugin manager with outboxkit's hook specs, entry points and ``plugins``.

    ``stores=False`` (an ``Outbox``'s) leaves out the entry points that only register stores:
    their one hook is ``open_store``'s, and parsing a plugin's hooks costs a millisecond per
    manager, which an ``Outbox`` made per test would pay for nothing.
    """
    pm = _PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if load_entry_points:
        for name, plugin in _entry_point_plugins() if stores else _entry_points_beyond_stores():
            if pm.get_plugin(name) is None and not pm.is_registered(plugin):
                register(pm, plugin, name=name)
    for plugin in plugins:
        if not pm.is_registered(plugin):
            register(pm, plugin)
    return pm


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager, reading only ``outboxkit_`` names as hook specifications.

    pluggy looks every name of the spec module up statically (``inspect.getattr_static``):
    for the imports and dunders of ``outboxkit.hookspecs`` that was most of the cost of a
    manager, paid per ``Outbox`` (one per test in an app's suite).
    """

    def parse_hookspec_opts(self, module_or_class: Any, name: str) -> pluggy.HookspecOpts | None:
        if not name.startswith(_HOOK_PREFIX):
            return None
        key = (module_or_class, name)
        if key not in _SPEC_OPTS:
            _SPEC_OPTS[key] = super().parse_hookspec_opts(module_or_class, name)
        opts = _SPEC_OPTS[key]
        return None if opts is None else pluggy.HookspecOpts(**opts)  # each manager its own


_SPEC_OPTS: dict[tuple[Any, str], pluggy.HookspecOpts | None] = {}
"""Each hook specification's options, read once per process (a static look-up per hook
that every manager repeated)."""


_HOOK_PREFIX = f"{hookspecs.PROJECT}_"
"""What every outboxkit hook's name starts with."""


def register(pm: pluggy.PluginManager, plugin: object, *, name: str | None = None) -> None:
    """Register ``plugin`` on ``pm``, refusing one with an ``async def`` hook implementation.

    Every outboxkit hook is called synchronously (observers on the poller's thread, between
    deliveries, by both pollers): a coroutine function's call would only make a coroutine
    that nobody awaits, so it would never run. Such a plugin is refused, left unregistered.

    Args:
        pm: the plugin manager (``make_plugin_manager``'s).
        plugin: the plugin object (an instance, a class or a module with hook implementations).
        name: the name to register it under (an entry point's); default pluggy's own.

    Raises:
        ConfigurationError: a hook implementation of ``plugin`` is an ``async def`` (or an
            async generator); the message names the plugin and the hook, and what to do.
    """
    registered = pm.register(plugin, name=name)
    for caller in pm.get_hookcallers(plugin) or ():
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and _is_async(impl.function):
                pm.unregister(plugin)
                raise ConfigurationError(_async_refusal(plugin, name or registered, caller.name))


def _is_async(function: object) -> bool:
    """Whether calling ``function`` (a hook implementation: pluggy takes routines only) makes
    a coroutine or an async generator instead of running it."""
    return inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)


def _label(plugin: object, name: str | None) -> str:
    """``plugin Class`` (a module's or a class's own name), with its entry-point name if it
    has one (pluggy's default name is a number: not shown)."""
    what = getattr(plugin, "__qualname__", None) or getattr(plugin, "__name__", None)
    what = what or type(plugin).__qualname__
    named = name and not name.isdigit() and name != what
    return f"plugin {what!s:.80}" + (f" ({name!s:.80})" if named else "")


def _async_refusal(plugin: object, name: str | None, hook: str) -> str:
    called = _label(plugin, name)
    if hook == "outboxkit_on_event":
        return (
            f"observer {called}: its outboxkit_on_event is an async def, which would never run: "
            "observers are called synchronously, on the poller's thread between deliveries, "
            "and nothing awaits them. Make it a plain def; an observer with async work to do "
            "hands the event to an event loop of its own without waiting (e.g. "
            "loop.call_soon_threadsafe(queue.put_nowait, event), or "
            "asyncio.run_coroutine_threadsafe(coroutine, loop))"
        )
    return (
        f"{called}: its {hook} is an async def, which outboxkit would never await (its hooks "
        "are called synchronously): make it a plain def"
    )


@functools.cache
def _entry_point_plugins() -> tuple[tuple[str, object], ...]:
    """The objects the ``outboxkit`` entry points name, loaded once per process.

    Scanning installed distributions costs milliseconds; the plugin *managers* stay one per
    ``Outbox`` (a test's observers never leak into another's), only the import is shared.
    """
    found = importlib.metadata.entry_points(group=hookspecs.PROJECT)
    return tuple((ep.name, ep.load()) for ep in sorted(found, key=lambda ep: ep.name))


@functools.cache
def _entry_points_beyond_stores() -> tuple[tuple[str, object], ...]:
    """The entry-point plugins with a hook besides ``outboxkit_register_stores`` (an observer,
    enqueue headers, a handler scope): what an ``Outbox``'s plugin manager needs of them."""
    pm = _PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    found: list[tuple[str, object]] = []
    for name, plugin in _entry_point_plugins():
        register(pm, plugin, name=name)
        hooks = {caller.name for caller in pm.get_hookcallers(plugin) or ()}
        if hooks - {"outboxkit_register_stores"}:
            found.append((name, plugin))
    return tuple(found)


@dataclass(frozen=True, slots=True)
class StoreEntry:
    name: str
    factory: hookspecs.StoreFactory
    schemes: tuple[str, ...]


def registered_stores(pm: pluggy.PluginManager) -> dict[str, StoreEntry]:
    """Every scheme the plugins registered, mapped to its store.

    Raises:
        ConfigurationError: two stores claim the same scheme, or a registration is malformed.
    """
    by_scheme: dict[str, StoreEntry] = {}

    def register(name: str, factory: hookspecs.StoreFactory, *, schemes: Iterable[str]) -> None:
        if not callable(factory):
            raise ConfigurationError(f"store {name!r} registered a factory that is not callable")
        entry = StoreEntry(name, factory, tuple(schemes))
        for scheme in entry.schemes:
            scheme = scheme.lower()
            if scheme in by_scheme and by_scheme[scheme].factory is not factory:
                raise ConfigurationError(
                    f"URL scheme {scheme!r} is registered twice: by store "
                    f"{by_scheme[scheme].name!r} and by store {name!r}"
                )
            by_scheme[scheme] = entry

    pm.hook.outboxkit_register_stores(register=register)
    return by_scheme


def open_store(url: Any, *, plugins: Iterable[object] = (), **options: Any) -> Any:
    """Open the store for ``url``, chosen by its scheme among the registered store plugins.

    ``sqlite:///path/app.db``, ``postgresql://user@host/db``, ``memory://`` ship with outboxkit;
    third-party stores register more schemes through the ``outboxkit`` entry-point group. A
    SQLAlchemy URL (``postgresql+psycopg://...``, ``sqlite+pysqlite:///...``) opens the store of
    its database (the store connects with its own driver), and a SQLAlchemy ``Engine`` opens
    a store on the engine's connections (``outboxkit.contrib.sqlalchemy.open_store``).

    Args:
        url: the store URL, or a framework's engine (a SQLAlchemy ``Engine``).
        plugins: extra plugin objects to consult besides the installed entry points.
        **options: passed to the store's factory (e.g. table names).

    Raises:
        UnknownStore: no store handles the scheme (the message lists the known ones).
        ConfigurationError: the URL is malformed or a scheme is registered twice.
        MissingDependency: the store's driver is not installed.
    """
    if not isinstance(url, str):
        from .contrib import integration_for

        integration = integration_for(url)
        if integration is not None and hasattr(integration, "open_store"):
            # A framework's engine (SQLAlchemy's): its integration opens the store on it.
            return integration.open_store(url, **options)
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(
            f"a store URL looks like 'scheme://...', got {redact_url(url)[:200]!r}"
        )
    scheme = url.split("://", 1)[0].lower()
    stores = registered_stores(make_plugin_manager(plugins))
    entry = stores.get(scheme)
    base, plus, _driver = scheme.partition("+")
    if entry is None and plus and base in stores:
        # A SQLAlchemy-style URL (postgresql+psycopg://, sqlite+pysqlite:///): the store
        # connects with its own driver, so the driver part is dropped.
        entry, url = stores[base], base + url[len(scheme) :]
    if entry is None:
        known = ", ".join(f"{s}://" for s in sorted(stores)) or "none"
        raise UnknownStore(f"no store is registered for {scheme[:40] + '://'!r}; known: {known}")
    try:
        return entry.factory(url, **options)
    except Exception as exc:
        # Whatever the store's own messages say, the URL's password never leaves in one.
        _scrub_exception(exc, secrets_of(url))
        raise


def _scrub_exception(exc: BaseException, secrets: tuple[str, ...]) -> None:
    """Remove ``secrets`` from the messages of ``exc`` and the exceptions chained to it."""
    if not secrets:
        return
    for cause in chain(exc):
        if any(isinstance(arg, str) for arg in cause.args):
            cause.args = tuple(
                scrub(arg, secrets) if isinstance(arg, str) else arg for arg in cause.args
            )


def notify(pm: pluggy.PluginManager, event: ObserverEvent) -> None:
    """Call every ``outboxkit_on_event`` implementation on its own.

    A failing observer is logged and skipped: it can neither silence the others nor break delivery.
    """
    for impl in pm.hook.outboxkit_on_event.get_hookimpls():
        try:
            result = impl.function(event=event)
            if result is not None and inspect.isawaitable(result):
                _drop_awaitable(_label(impl.plugin, impl.plugin_name), result)
        except Exception:
            log.exception(
                "observer %s failed on %s; delivery goes on", impl.plugin_name, type(event).__name__
            )


def _drop_awaitable(label: str, result: Any) -> None:
    """An observer that ``register`` could not tell was async (a plain function returning a
    coroutine) returned an awaitable: closed unrun, so that no "never awaited" warning comes
    later from the garbage collector, and said once per call in the log."""
    close = getattr(result, "close", None)
    if callable(close):
        close()
    log.error(
        "observer %s returned an awaitable, which outboxkit does not await: it did not run "
        "(observers must be plain functions)",
        label,
    )
