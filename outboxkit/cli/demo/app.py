"""The shop's outbox as an app module: ``outboxkit run outboxkit.cli.demo.app:outbox``.

Importing it opens the shop's SQLite file named by ``SHOP_DB`` (default ``outboxkit-demo.db`` in
the working directory, the file ``outboxkit demo`` writes), creating the shop's tables and the
outbox's when missing. The demo's mail server is flaky on purpose; here it works, unless
``SHOP_MAIL_FAILURE_RATE`` (0 to 1) says otherwise - so the receipts the demo dead-lettered go
out once they are requeued (``outboxkit dead requeue --all``) and this poller runs.
"""

from __future__ import annotations

import os
import sqlite3

from outboxkit import open_store

from .runner import BACKOFF, DEFAULT_DB, MAX_RETRIES
from .shop import create_tables, mailer, make_outbox

__all__ = ["DB", "outbox"]

DB = os.environ.get("SHOP_DB") or DEFAULT_DB
mailer.failure_rate = float(os.environ.get("SHOP_MAIL_FAILURE_RATE") or 0.0)

_conn = sqlite3.connect(DB, timeout=30)
try:
    create_tables(_conn)
finally:
    _conn.close()

outbox = make_outbox(open_store(f"sqlite:///{DB}"), max_retries=MAX_RETRIES, backoff=BACKOFF)
