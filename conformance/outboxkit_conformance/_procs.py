"""Child-process work for the multi-process checks (importable by ``spawn`` children)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from outboxkit import open_store
from outboxkit.core.machine import Publish
from outboxkit.store import settle_one


def claim_until_empty(
    url: str, options: dict[str, Any], now_iso: str, batch_size: int
) -> list[int]:
    """Open the store afresh, claim and publish until nothing is due; return the ids claimed."""
    store = open_store(url, **options)
    now = datetime.fromisoformat(now_iso)
    seen: list[int] = []
    try:
        while claims := store.claim(batch_size=batch_size, lease=timedelta(minutes=10), now=now):
            for claim in claims:
                seen.append(claim.event.id)
                settle_one(store, claim, Publish(), error=None, now=now)
    finally:
        store.close()
    return seen
