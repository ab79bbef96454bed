"""``outboxkit doctor``: reads the store and its server, prints each finding with its fix, and
exits 1 when one is a problem (0 with warnings only); ``--json`` for machines.

The checks every store answers are ``outboxkit.diagnosis``'s; a PostgreSQL store adds its
server's (``outboxkit_pg.doctor``). Creates, migrates and changes nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import click

from ..diagnosis import Finding, Limits, outbox_findings, unreachable, worst
from ..errors import StoreError
from ..outbox import Outbox
from .ops import dead_key_policy
from .output import echo, print_json
from .params import DURATION
from .stores import open_outbox, with_store_options

__all__ = ["doctor"]

_LABEL = {"ok": "ok", "warning": "WARNING", "problem": "PROBLEM"}


@click.command(short_help="Check the store and its server; each finding with its fix.")
@with_store_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--backlog-after",
    type=DURATION,
    default="5m",
    show_default=True,
    help="An oldest due event waiting longer is a problem.",
)
@click.option(
    "--stale-after",
    type=DURATION,
    default="1m",
    show_default=True,
    help="A lease run out this long ago, its event not claimed again, is a problem.",
)
@click.option(
    "--transaction-after",
    type=DURATION,
    default="5m",
    show_default=True,
    help="A transaction open longer (holding back vacuum) is a problem (PostgreSQL).",
)
def doctor(
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
    as_json: bool,
    backlog_after: timedelta,
    stale_after: timedelta,
    transaction_after: timedelta,
) -> None:
    """Check the store and its server: the schema and missing migrations, the backlog's age,
    dead letters and the keys they hold; on PostgreSQL also the oldest transaction holding back
    vacuum, dead rows and bloat of the outbox tables, stale leases and settings that hurt
    (idle_in_transaction_session_timeout unset...). Exit 1 on a problem, 0 otherwise."""
    limits = Limits(backlog=backlog_after, stale_lease=stale_after, transaction=transaction_after)
    with open_outbox(
        app=app, store_url=store_url, store_options=store_options, existing=True
    ) as outbox:
        findings = diagnose(outbox, limits, dead_key_policy(outbox, app))
    severity = worst(findings)
    if as_json:
        print_json(
            {
                "store": repr(outbox.store),
                "result": severity,
                "findings": [
                    {
                        "check": f.check,
                        "severity": f.severity,
                        "summary": f.summary,
                        "fix": f.fix or None,
                        "details": f.details,
                    }
                    for f in findings
                ],
            }
        )
    else:
        echo(f"store: {outbox.store!r}")
        for finding in sorted(findings, key=_most_severe_first):
            echo(f"{_LABEL[finding.severity]:8} {finding.check}: {finding.summary}")
            if finding.fix:
                echo(f"{'':8} fix: {finding.fix}")
        problems = sum(f.severity == "problem" for f in findings)
        warnings = sum(f.severity == "warning" for f in findings)
        echo(f"{problems} problem(s), {warnings} warning(s)")
    sys.exit(1 if severity == "problem" else 0)


def diagnose(outbox: Outbox, limits: Limits, policy: Any) -> list[Finding]:
    """Every finding: the store's, then its server's (PostgreSQL)."""
    try:
        findings, _ = outbox_findings(outbox, limits, policy)
    except StoreError as exc:
        return [unreachable(exc)]
    server = _server_findings(outbox, limits)
    return findings + server


def _server_findings(outbox: Outbox, limits: Limits) -> list[Finding]:
    try:
        from outboxkit_pg import PostgresStore
        from outboxkit_pg.doctor import server_findings
    except ImportError:  # no PostgreSQL extra: no PostgreSQL store either
        return []
    if not isinstance(outbox.store, PostgresStore):
        return []
    try:
        return server_findings(outbox.store, limits)
    except StoreError as exc:
        return [unreachable(exc)]


def _most_severe_first(finding: Finding) -> int:
    return {"problem": 0, "warning": 1, "ok": 2}[finding.severity]
