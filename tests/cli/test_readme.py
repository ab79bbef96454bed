"""The README's promises about the command: how it starts, and what Operations documents."""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs import page

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_the_readme_starts_with_the_two_commands_of_a_new_user() -> None:
    lines = README.splitlines()
    assert lines[0] == "# outboxkit"
    assert lines[1] == "" and lines[2] and lines[3] == ""  # the one-line description
    assert lines[4] == "```bash" and lines[7] == "```", lines[:8]
    demo, tests = lines[5], lines[6]
    assert "pip install ." in demo and demo.endswith("outboxkit demo"), demo
    assert 'pip install -e ".[dev]"' in tests and tests.endswith("python -m pytest -q -n 2"), tests


def test_ci_runs_the_first_command_as_written() -> None:
    # .ci/run reads the first line of the README's first bash block and runs it verbatim.
    assert "awk '/^```bash$/ { inside = 1; next } inside { print; exit }' README.md" in CI
    assert 'bash -euo pipefail -c "$DEMO_COMMAND"' in CI


def test_operations_documents_every_command_and_option() -> None:
    section = page("how-to/operations.md")
    for text in [
        "outboxkit run",
        "--interval",
        "--batch-size",
        "--lease",
        "--max-retries",
        "--store URL",
        "--store-option",
        "OUTBOXKIT_STORE",
        "--app",
        "--until-idle",
        "--asyncio",
        "--concurrency",
        "--processes",
        "--grace",
        "--log-every",
        "--log-level",
        "SIGTERM",
        "outboxkit status",
        "--json",
        "outboxkit dead list",
        "--topic",
        "--since",
        "--limit",
        "outboxkit dead show",
        "outboxkit dead requeue",
        "--all",
        "outboxkit dead purge",
        "--older-than",
        "outboxkit purge --published-older-than",
        "outboxkit migrate",
        "outboxkit demo",
        "--dry-run",
        "--yes",
        "outboxkit web",
        "--token",
        "--host",
        "--sample-every",
        "created schema v7",
        "retain_published",
        "1,000 rows",
        "exit code 2",
    ]:
        assert text in section, text
    assert re.search(r"`30d`, `12h`, `15m`, `10s`, `500ms`", section)
