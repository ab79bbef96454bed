"""The one loader of ``module:attribute`` specs: ``outboxkit run APP``, ``--app``, the pytest
plugin's ``outboxkit_app`` and the conformance runner's store factory all name their object so.

Light on purpose (no click, nothing of the CLI): the pytest plugin imports it.

A Django project loads too: with ``DJANGO_SETTINGS_MODULE`` set, Django is set up
(``django.setup()``) before the module is imported, so ``outboxkit run myapp.events:outbox``
works on the app's models as ``manage.py outboxkit run`` does.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ConfigurationError

__all__ = ["DJANGO_SETTINGS_ENV", "LoadError", "load_object"]

DJANGO_SETTINGS_ENV = "DJANGO_SETTINGS_MODULE"


class LoadError(ConfigurationError):
    """A ``module:attribute`` spec that names nothing usable: malformed, a module that does not
    import, a missing attribute, or an object of the wrong kind (the message says which)."""


def load_object(
    spec: str,
    *,
    what: str,
    kind: type | Callable[[object], bool] | None = None,
    example: str = "myapp.events:outbox",
) -> Any:
    """The object ``module:attribute.path`` names; the working directory is importable.

    Args:
        spec: ``module:attribute`` (the attribute may be dotted).
        what: what the spec is for, in messages (``APP``, ``store factory`` ...).
        kind: the type the object must be, or None; a callable is required when ``kind`` is
            ``callable``.
        example: a well-formed spec, for the message about a malformed one.

    Raises:
        LoadError: naming the spec and what is wrong with it.
    """
    module_name, sep, attribute = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attribute:
        raise LoadError(f"{what} must be module:attribute (e.g. {example}), got {spec!r:.200}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    _setup_django(what)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}{_django_hint(exc)}"
        raise LoadError(f"cannot import {module_name!r} for {what} {spec!r}: {problem}") from None
    try:
        for part in attribute.split("."):
            target = getattr(target, part)
    except AttributeError:
        raise LoadError(
            f"{what} {spec!r}: {module_name!r} has no attribute {attribute!r}"
        ) from None
    if kind is callable and not callable(target):
        raise LoadError(f"{what} {spec!r} is not callable: {target!r:.80}")
    if isinstance(kind, type) and not isinstance(target, kind):
        raise LoadError(
            f"{what} {spec!r} is {_a(type(target).__name__)}, not {_a(_public_name(kind))}"
        )
    return target


def _setup_django(what: str) -> None:
    """A Django project's modules import only once Django is set up: with
    ``DJANGO_SETTINGS_MODULE`` set, set it up first (a no-op when it already is: under
    ``manage.py`` or pytest-django)."""
    if not os.environ.get(DJANGO_SETTINGS_ENV):
        return
    try:
        import django
        from django.apps import apps
    except ImportError:
        return  # not a Django project after all: the import says what is missing
    if apps.ready:
        return
    try:
        django.setup()
    except Exception as exc:
        raise LoadError(
            f"{DJANGO_SETTINGS_ENV}={os.environ[DJANGO_SETTINGS_ENV]!r:.200} is set, and Django "
            f"could not be set up with it (for {what}): {type(exc).__name__}: {exc}"
        ) from None


def _django_hint(exc: Exception) -> str:
    """What to do when a module failed to import because Django is not set up."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"AppRegistryNotReady", "ImproperlyConfigured"} and not os.environ.get(
        DJANGO_SETTINGS_ENV
    ):
        return (
            f" (a Django project: set {DJANGO_SETTINGS_ENV}, e.g. "
            f"{DJANGO_SETTINGS_ENV}=mysite.settings, or run `manage.py outboxkit`)"
        )
    return ""


def _public_name(kind: type) -> str:
    """``outboxkit.Outbox`` rather than ``outboxkit.outbox.Outbox``: the name users import, when
    the top-level package exports the class."""
    top = kind.__module__.partition(".")[0]
    if getattr(sys.modules.get(top), kind.__qualname__, None) is kind:
        return f"{top}.{kind.__qualname__}"
    return f"{kind.__module__}.{kind.__qualname__}"


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"
