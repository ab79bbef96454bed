"""What ``outboxkit doctor`` reports: findings, each with what was seen and the fix.

The checks every store answers (the schema, the backlog's age, dead letters, the keys they
hold) live here, on the ``Outbox``; a store package adds its server's (``outboxkit_pg.doctor``:
bloat, dead tuples, the oldest transaction holding back vacuum, stale leases, settings).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from .core.model import DeadKey, Stats
from .errors import SchemaError, StoreError
from .reading import dead_keys

if TYPE_CHECKING:
    from .outbox import Outbox

__all__ = ["Finding", "Limits", "Severity", "outbox_findings"]

Severity = Literal["ok", "warning", "problem"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One check's result: ``check`` names it, ``summary`` says what was seen, ``fix`` what to
    do (empty when all is well), ``details`` the figures (JSON-ready)."""

    check: str
    severity: Severity
    summary: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Limits:
    """Where a finding becomes a problem."""

    backlog: timedelta = timedelta(minutes=5)
    """The oldest due event waiting longer than this."""
    stale_lease: timedelta = timedelta(minutes=1)
    """A lease run out this long ago and its event not claimed again."""
    transaction: timedelta = timedelta(minutes=5)
    """A transaction open this long (it holds back vacuum)."""


def outbox_findings(
    outbox: Outbox, limits: Limits, policy: DeadKey | None
) -> tuple[list[Finding], Stats | None]:
    """The checks any store answers; the stats read, or None when the store has no usable
    schema (the other checks then need it first).

    Raises:
        StoreError: the store failed otherwise (unreachable...).
    """
    try:
        stats = outbox.stats()
    except SchemaError as exc:
        return [
            Finding(
                "schema",
                "problem",
                str(exc),
                fix="outboxkit migrate --store URL (the database's own address, not a pooler's)",
            )
        ], None
    findings = [Finding("schema", "ok", "the store's schema is the one this outboxkit needs")]
    findings.append(_backlog(outbox, stats, limits))
    findings.append(_dead_letters(stats))
    findings.append(_held_keys(outbox, stats, policy))
    return findings, stats


def _backlog(outbox: Outbox, stats: Stats, limits: Limits) -> Finding:
    if stats.oldest_due_at is None:
        return Finding("backlog", "ok", f"nothing due ({stats.pending} pending in all)")
    age = max((outbox.now() - stats.oldest_due_at).total_seconds(), 0.0)
    details = {"oldest_due_age_seconds": age, "pending": stats.pending, "in_flight": stats.claimed}
    summary = f"the oldest due event has waited {age:.1f}s ({stats.pending} pending)"
    if age <= limits.backlog.total_seconds():
        return Finding("backlog", "ok", summary, details=details)
    return Finding(
        "backlog",
        "problem",
        summary + f", more than {limits.backlog.total_seconds():g}s",
        fix="start pollers (outboxkit run APP), or more of them (--processes N); if they run, "
        "look for a handler that blocks and for the oldest transaction below",
        details=details,
    )


def _dead_letters(stats: Stats) -> Finding:
    if not stats.dead:
        return Finding("dead_letters", "ok", "no dead letters")
    return Finding(
        "dead_letters",
        "warning",
        f"{stats.dead} dead letter(s)",
        fix="outboxkit dead list; requeue what was fixed (outboxkit dead requeue ID...), purge "
        "the rest (outboxkit dead purge ID...)",
        details={"dead": stats.dead},
    )


def _held_keys(outbox: Outbox, stats: Stats, policy: DeadKey | None) -> Finding:
    count = stats.dead_keys
    if not count:
        return Finding("held_keys", "ok", "no key has a dead event")
    shown = dead_keys(outbox, limit=5)
    named = ", ".join(f"{k.key!r} (dead event {k.dead.event.id})" for k in shown)
    more = f" and {count - len(shown)} more" if count > len(shown) else ""
    details = {
        "dead_key": policy,
        "keys_with_a_dead_event": count,
        "keys": [{"key": k.key, "event_id": k.dead.event.id} for k in shown],
    }
    fix = "outboxkit dead requeue ID (once the cause is fixed) or outboxkit dead purge ID"
    if policy == "release":
        return Finding(
            "held_keys", "ok", f"{count} key(s) have a dead event, none held (release)", "", details
        )
    if policy == "hold":
        summary = f"{count} key(s) held by a dead event: {named}{more}"
        return Finding("held_keys", "problem", summary, fix, details)
    summary = (
        f"{count} key(s) have a dead event: {named}{more}; held if the app's dead_key is 'hold' "
        "(pass --app to know)"
    )
    return Finding("held_keys", "warning", summary, fix, details)


def worst(findings: Sequence[Finding]) -> Severity:
    """The most severe of ``findings``."""
    order: dict[Severity, int] = {"ok": 0, "warning": 1, "problem": 2}
    return max((f.severity for f in findings), key=order.__getitem__, default="ok")


def unreachable(exc: StoreError) -> Finding:
    """The store could not be read at all."""
    return Finding("store", "problem", str(exc), fix="check the URL, the server, the credentials")
