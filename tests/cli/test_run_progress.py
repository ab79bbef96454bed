"""``outboxkit run --until-idle`` on a terminal (a real pseudo-terminal): one progress display
for the whole group, on the last line, never sharing a line with a log line; off a terminal,
no display at all (``test_run.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from outboxkit import Outbox, Store
from tests.backends import Target

from .apps import App
from .conftest import Cli, on_a_terminal

ERASE = "\x1b[K"


def _jobs(store: Store, payloads: list[dict[str, Any]]) -> None:
    outbox = Outbox(store, load_entry_points=False)
    with store.transaction() as conn:
        for payload in payloads:
            outbox.enqueue(conn, "job.run", payload)


@pytest.mark.parametrize("processes", [1, 2])
def test_one_progress_display_for_the_group_apart_from_the_log_lines(
    process_cli: Cli, target: Target, store: Store, app: App, processes: int
) -> None:
    _jobs(store, [{}] * 30 + [{"fail": True}] * 2)
    code, output = on_a_terminal(
        process_cli,
        [
            "run",
            app.spec(),
            "--processes",
            str(processes),
            "--until-idle",
            "--batch-size",
            "4",
            "--interval",
            "50ms",
            "--max-retries",
            "0",
        ],
    )
    assert code == 0, output
    assert "draining [" in output and ERASE in output, output
    lines = [line.rstrip("\r") for line in output.split("\n")]
    # What a terminal keeps of each finished line: what follows its last erase.
    kept = [line.rsplit(ERASE, 1)[-1] for line in lines[:-1]]
    assert kept and all("draining [" not in line for line in kept), output
    assert all("\x1b" not in line for line in kept)  # nothing else is drawn
    assert "handler work failed on attempt 1" in output  # a failure, written above
    if processes == 2:
        # The children's log lines, relayed above the supervisor's one display.
        assert any("[poller 1/2 pid" in line for line in kept), output
        assert any("[poller 2/2 pid" in line for line in kept), output
        assert any(line.endswith("all 2 poller processes stopped") for line in kept), output
    # The drain's true end, kept as a line of its own: every event counted, rate, time taken.
    [final] = [line for line in kept if line.startswith("drained [")]
    assert final.startswith(f"drained [{'#' * 24}] 32/32 (in "), output
    assert "/s, 2 dead-lettered)" in final, output
    assert lines[-1].rsplit(ERASE, 1)[-1] == ""  # the display is erased at the end
    assert store.stats(now=None).published == 30
