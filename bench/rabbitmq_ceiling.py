"""RabbitMQ's own ceiling: persistent, mandatory messages published with confirms, no database.

``relay.py`` compares the RabbitMQ relay with a one-at-a-time handler; ten times that handler's
rate is more than the broker takes here from any client. This script measures what the broker
takes: ``--messages`` persistent messages (``delivery_mode=2``, ``mandatory=True``) to a durable
queue of its own (deleted afterwards), in batches of ``--batch`` whose confirms are awaited
together, on 1, 2, 4 and 8 channels of one connection at once. Nothing is read from or written to
a database, so no relay can publish the same messages faster.

    python bench/rabbitmq_ceiling.py
    python bench/rabbitmq_ceiling.py --messages 5000 --channels 1 --channels 4
"""

from __future__ import annotations

import argparse
import asyncio
import time

QUEUE = "outboxkit-bench-ceiling"
BODY = b'{"n":1}'


async def publish_all(url: str, messages: int, batch: int, channels: int) -> float:
    """Messages per second for ``messages`` published over ``channels`` channels at once."""
    import aio_pika

    connection = await aio_pika.connect(url)
    try:
        admin = await connection.channel()
        queue = await admin.declare_queue(QUEUE, durable=True)
        await queue.purge()
        opened = [await connection.channel(publisher_confirms=True) for _ in range(channels)]

        async def worker(index: int) -> None:
            exchange = opened[index].default_exchange
            for start in range(index * batch, messages, batch * channels):
                await asyncio.gather(
                    *(
                        exchange.publish(
                            aio_pika.Message(BODY, delivery_mode=2, message_id=str(n)),
                            routing_key=QUEUE,
                            mandatory=True,
                        )
                        for n in range(start, min(messages, start + batch))
                    )
                )

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(channels)))
        seconds = time.perf_counter() - started
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()
    return messages / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1/")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--channels", type=int, action="append", default=[])
    args = parser.parse_args()
    if args.messages < 1 or args.batch < 1 or any(c < 1 for c in args.channels):
        parser.error("--messages, --batch and --channels must be at least 1")
    for channels in args.channels or [1, 2, 4, 8]:
        rate = asyncio.run(publish_all(args.url, args.messages, args.batch, channels))
        print(f"{channels} channel(s): {rate:,.0f} messages/s")


if __name__ == "__main__":
    main()
