"""Django's connection as the Django store sees it: this thread's wrapper for an alias, the
rollback mark of its atomic block, and closing a stale one between batches."""

from __future__ import annotations

from typing import Any

from outboxkit.core.model import Claim
from outboxkit.errors import HandlerCrashed

__all__ = ["close_if_stale", "django_connection", "marked", "refuse_marked"]


def django_connection(alias: str) -> Any:
    """This thread's ``DatabaseWrapper`` for ``alias``, connected."""
    from django.db import connections

    wrapper = connections[alias]
    wrapper.ensure_connection()
    return wrapper


def marked(alias: str) -> bool:
    """Whether Django's atomic block on ``alias`` is marked for rollback (``needs_rollback``):
    a database error inside it that the code caught (an ORM ``IntegrityError``) leaves it so,
    and Django then rolls the block back when it ends, without raising."""
    from django.db import connections

    return bool(connections[alias].needs_rollback)


def refuse_marked(alias: str, claim: Claim, before: bool) -> None:
    """R17: a delivery whose handler left Django's atomic block marked for rollback fails: its
    writes, and the record, would otherwise be rolled back silently when the block ends, and
    the event published as delivered.

    Raises:
        HandlerCrashed: the block is marked now and was not when the handler started.
    """
    if not before and marked(alias):
        raise HandlerCrashed(
            f"event {claim.event.id}: the handler left Django's transaction marked for "
            "rollback (a database error it caught, such as an IntegrityError, inside the "
            "delivery's atomic block, or transaction.set_rollback(True)); nothing of this "
            "delivery was committed and it runs again. Wrap a write that may fail in its own "
            "transaction.atomic() block to recover from it inside the handler"
        )


def close_if_stale(alias: str) -> None:
    """Between batches, what Django does between requests (``close_old_connections``): drop
    this thread's connection if it is broken or past ``CONN_MAX_AGE``."""
    from django.db import connections

    wrapper = connections[alias]
    if not wrapper.in_atomic_block:
        wrapper.close_if_unusable_or_obsolete()
