"""A poller process relaying one SQLite file's events to a broker, for the SIGKILL test.

    python -m tests.faults._relay_poller DB BROKER URL PREFIX

It runs the blocking poller (``per_batch``, lease 2 s) until it is killed. After its fifth batch
is confirmed by the broker, and before the poller records it, it creates ``DB.inflight`` and
hangs there: the parent SIGKILLs it then, mid-batch, with a whole batch published and not
recorded (the worst moment for duplicates).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from outboxkit import EventBus, Outbox, open_store

HANG_AFTER = 5


def hanging(relay: Any, marker: Path) -> Any:
    """``relay`` whose blocking publish hangs after its ``HANG_AFTER``-th confirmed batch."""
    publish = relay.publish_blocking
    batches = 0

    def publish_blocking(events: Any) -> Any:
        nonlocal batches
        answers = publish(events)
        batches += 1
        if batches == HANG_AFTER:
            marker.touch()
            threading.Event().wait()  # until SIGKILL
        return answers

    relay.publish_blocking = publish_blocking
    return relay


def main(db: str, broker: str, url: str, prefix: str) -> None:
    if broker == "rabbitmq":
        from outboxkit.relay.rabbitmq import RabbitMQRelay

        relay: object = RabbitMQRelay(url, exchange=prefix)
    elif broker == "nats":
        from outboxkit.relay.nats import NatsRelay

        relay = NatsRelay(url)
    else:
        from outboxkit.relay.redis import RedisRelay

        relay = RedisRelay(url, client_name=f"okt-{prefix}")
    bus = EventBus()
    relay = hanging(relay, Path(f"{db}.inflight"))
    bus.relay(relay, topics=[f"{prefix}.#"], name="relay")  # type: ignore[arg-type]
    outbox = Outbox(open_store(f"sqlite:///{db}"), bus, load_entry_points=False)
    outbox.poller(batch_size=100, transaction="per_batch", lease=2.0, interval=0.05).run_forever()


if __name__ == "__main__":
    main(*sys.argv[1:5])
