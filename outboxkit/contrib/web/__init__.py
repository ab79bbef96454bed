"""``outboxkit web``: a small dashboard over an outbox's store, in the browser.

Counters and backlog over time (``stats()`` sampled on the server, drawn as an inline SVG),
the oldest due events, dead letters (list, one with its delivery records and last error,
requeue, purge) and failures by handler. Server-rendered HTML from the standard library's
``http.server``: ``outboxkit[web]`` installs nothing more.

- ``Dashboard``: what is shown and done, without HTTP;
- ``DashboardServer``: serving it (``server``: what keeps it from hurting — 127.0.0.1 by
  default, a token and a same-origin check on every action, escaped values);
- ``pages``: the HTML.

In Python::

    from outboxkit.contrib.web import Dashboard, DashboardServer

    server = DashboardServer(Dashboard(outbox, token="a long secret"), port=8025)
    server.serve_forever()
"""

from __future__ import annotations

from .dashboard import Dashboard, HandlerFailures, Sample
from .server import DashboardServer

__all__ = ["Dashboard", "DashboardServer", "HandlerFailures", "Sample"]
