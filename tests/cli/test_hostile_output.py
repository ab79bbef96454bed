"""Stored text never reaches a terminal raw.

Topics, keys, headers, payloads, rejection reasons and error texts can carry whatever an app
(or a payload it copied into an error message) put there: clear-screen, window-title,
hyperlink and cursor sequences, C1 controls, bidirectional overrides. ``dead list``, ``dead
show`` and ``status`` print them through one function that shows every such character as an
escape (``\\x1b``), on a pseudo-terminal and through a pipe alike; ``--json`` escapes them as
``\\uXXXX``, so the JSON still decodes to the exact stored text.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from outboxkit import Event, EventBus, FrozenClock, Outbox, Reject, Store
from tests.backends import Target

from .conftest import Cli, on_a_terminal

CLEAR = "\x1b[2J\x1b[H"
TITLE = "\x1b]0;pwned\x07"
LINK = "\x1b]8;;http://evil.example\x1b\\click\x1b]8;;\x1b\\"
C1 = "\x9b31m\x9d0;t\x9c"
BIDI = "\u202egnp.exe"
HOSTILE_TOPIC = f"order{CLEAR}.placed{TITLE}"
HOSTILE_KEY = f"key{LINK}"
HOSTILE_HEADER = f"h{C1}"
HOSTILE_ERROR = f"boom{TITLE}{BIDI}\x7f\x08"
HOSTILE_REASON = f"no{CLEAR}{LINK}"

# What must never be printed: C0 controls but the line break, DEL, C1, the bidi controls.
FORBIDDEN = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _seed(store: Store) -> tuple[int, int]:
    bus = EventBus()

    @bus.handler(HOSTILE_TOPIC, name="fails")
    def fails(event: Event, ctx: Any) -> None:
        if event.payload.get("reject"):
            raise Reject(HOSTILE_REASON)
        raise RuntimeError(HOSTILE_ERROR)

    @bus.handler(HOSTILE_TOPIC, name="rejects")
    def rejects(event: Event, ctx: Any) -> None:
        raise Reject(HOSTILE_REASON)

    outbox = Outbox(store, bus, clock=FrozenClock(), max_retries=0, load_entry_points=False)
    with store.transaction() as conn:
        dead = outbox.enqueue(
            conn,
            HOSTILE_TOPIC,
            {"note": f"{CLEAR}{BIDI}{C1}"},
            key=HOSTILE_KEY,
            headers={HOSTILE_HEADER: TITLE},
        )
        pending = outbox.enqueue(conn, HOSTILE_TOPIC, {}, delay=3600)
    report = outbox.poller().run_once()
    assert report.dead_lettered == [dead]
    return dead, pending


def _on_a_terminal(cli: Cli, args: list[str]) -> str:
    """``outboxkit ARGS`` with stdout and stderr on a pseudo-terminal; what it showed."""
    code, shown = on_a_terminal(cli, args)
    assert code == 0, shown
    return shown.replace("\r\n", "\n")


@pytest.mark.parametrize(
    "command", ["dead list", "dead show {dead}", "status"], ids=["list", "show", "status"]
)
def test_stored_text_is_printed_without_control_characters(
    process_cli: Cli, target: Target, store: Store, command: str
) -> None:
    dead, _ = _seed(store)
    args = [*command.format(dead=dead).split(), *target.cli_args()]
    piped = process_cli(*args)
    assert piped.code == 0, piped
    shown = _on_a_terminal(process_cli, args)
    for output in (piped.stdout + piped.stderr, shown):
        assert not FORBIDDEN.findall(output), output
        assert "order\\x1b[2J\\x1b[H.placed\\x1b]0;pwned\\x07" in output  # visibly escaped
    if command.startswith("dead show"):
        assert "boom\\x1b]0;pwned\\x07\\u202egnp.exe\\x7f\\x08" in shown
        assert "no\\x1b[2J" in shown and "key\\x1b]8;;http://evil.example" in shown
        assert "h\\x9b31m" in shown


@pytest.mark.parametrize(
    "command",
    ["dead list --json", "dead show {dead} --json", "status --json"],
    ids=["list", "show", "status"],
)
def test_json_output_escapes_control_characters_and_decodes_to_the_stored_text(
    process_cli: Cli, target: Target, store: Store, command: str
) -> None:
    dead, _ = _seed(store)
    args = [*command.format(dead=dead).split(), *target.cli_args()]
    for output in (process_cli(*args).stdout, _on_a_terminal(process_cli, args)):
        assert not FORBIDDEN.findall(output), output
        data = json.loads(output)
        if command.startswith("status"):
            assert HOSTILE_TOPIC in data["by_topic"]
            continue
        letter = data[0] if isinstance(data, list) else data
        assert letter["topic"] == HOSTILE_TOPIC
        assert letter["key"] == HOSTILE_KEY
        assert letter["headers"] == {HOSTILE_HEADER: TITLE}
        assert letter["payload"] == {"note": f"{CLEAR}{BIDI}{C1}"}
        assert letter["last_error"] == f"fails: RuntimeError: {HOSTILE_ERROR}"
        assert [r["reason"] for r in letter["records"]] == [HOSTILE_REASON]
