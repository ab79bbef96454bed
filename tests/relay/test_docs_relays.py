"""The relays page's consumer block runs as written: the ``Inbox`` made and migrated on the
consumer's psycopg connection, and its ``on_message`` applying a message once though it is
delivered twice (a message of the shape aio-pika hands a consumer)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from outboxkit.relay import MESSAGE_ID_HEADER
from tests.docs import page, python_blocks
from tests.relay.test_inbox import consumer_db

pytestmark = pytest.mark.pg


class Message:
    """What the block reads of an aio-pika message: its id, headers, body and ``ack()``."""

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self.headers = {MESSAGE_ID_HEADER: message_id}
        self.body = b'{"amount": 5}'
        self.acked = 0

    async def ack(self) -> None:
        self.acked += 1


def test_the_inbox_block_applies_a_message_once(tmp_path: Path) -> None:
    (_, consumer) = python_blocks(page("how-to/relays.md"))
    applied: list[str] = []

    def apply_payment(conn: Any, message: Message) -> None:
        conn.execute(
            "INSERT INTO applied (event_id, body) VALUES (1, %s)", (message.body.decode(),)
        )
        applied.append(message.message_id)

    with consumer_db("pg", tmp_path) as conn:
        namespace: dict[str, Any] = {"conn": conn, "apply_payment": apply_payment}
        exec(compile(consumer, "docs/how-to/relays.md", "exec"), namespace)
        conn.commit()  # the block's migrate ran in conn's transaction: the caller commits
        message = Message(str(uuid.uuid4()))
        asyncio.run(namespace["on_message"](message))
        asyncio.run(namespace["on_message"](message))  # delivered twice
        assert applied == [message.message_id]
        assert message.acked == 2
        assert conn.execute("SELECT count(*) FROM applied").fetchone() == (1,)
