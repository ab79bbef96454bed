"""``outboxkit web``: the dashboard (``outboxkit.contrib.web``) on a store, until Ctrl-C or
SIGTERM."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import click

from ..core.text import redact_url
from .errors import InputError
from .output import echo
from .params import DURATION, Whole
from .signals import stop_signals
from .stores import open_outbox, with_store_options

__all__ = ["web_command"]


@click.command("web", short_help="A dashboard in the browser: backlog, dead letters, failures.")
@with_store_options
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="The address to bind (this machine)."
)
@click.option("--port", type=Whole(0, 65535), default=8025, show_default=True, help="0: any free.")
@click.option(
    "--token",
    envvar="OUTBOXKIT_WEB_TOKEN",
    show_envvar=True,
    default=None,
    help="The secret signing in needs (at least 8 characters; requeue and purge need a "
    "session); default: generated and printed once.",
)
@click.option(
    "--sample-every",
    type=DURATION,
    default="5s",
    show_default=True,
    help="How often the backlog chart samples the store's stats.",
)
def web_command(
    app: str | None,
    store_url: str | None,
    store_options: Sequence[Any],
    host: str,
    port: int,
    token: str | None,
    sample_every: timedelta,
) -> None:
    """Serve the dashboard: counters and backlog over time (refreshed every 10 s), the oldest
    due events, held keys, every event and dead letter page by page with filters, requeue and
    purge (one, or every match after a preview), failures by handler. Binds 127.0.0.1 unless
    --host says otherwise; actions need a session (sign in once with the token). Creates and
    migrates nothing."""
    from ..contrib.web import Dashboard, DashboardServer

    if sample_every.total_seconds() < 0.1:
        raise InputError("--sample-every must be at least 100ms")
    with open_outbox(
        app=app, store_url=store_url, store_options=store_options, existing=True
    ) as outbox:
        outbox.stats()  # the store answers (and has a schema) before anything is served
        name = redact_url(store_url) if store_url else None
        # The dead-key policy is the app's with --app; without it the page says it is unknown.
        dashboard = Dashboard(outbox, token=token, name=name, policy_known=app is not None)
        try:
            server = DashboardServer(
                dashboard, host=host, port=port, sample_every=sample_every.total_seconds()
            )
        except OSError as exc:
            raise InputError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
        with stop_signals(lambda signum, frame: server.request_stop()):
            echo(f"outboxkit dashboard on {server.origin}/ for {outbox.store!r}")
            if token is None:
                echo(f"sign-in token (shown only now): {dashboard.token}")
            server.serve_forever()
        echo("stopped")
