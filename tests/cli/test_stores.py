"""Which outbox a command works on (``outboxkit.cli.stores``): the public names, and an APP
that names nothing usable as the command's wrong input."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import outboxkit.cli
from outboxkit import Outbox
from outboxkit.cli import STORE_ENV, STORE_OPTIONS_ENV, load_app
from outboxkit.cli.apps import LoadError, load_object
from outboxkit.cli.errors import WRONG_INPUT, InputError


def test_the_public_names() -> None:
    assert (STORE_ENV, STORE_OPTIONS_ENV) == ("OUTBOXKIT_STORE", "OUTBOXKIT_STORE_OPTIONS")
    assert set(outboxkit.cli.__all__) == {
        "STORE_ENV",
        "STORE_OPTIONS_ENV",
        "cli",
        "load_app",
        "main",
        "parse_duration",
    }


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "stores_test_app"
    (tmp_path / f"{name}.py").write_text(
        "from outboxkit import EventBus, MemoryStore, Outbox\n"
        "outbox = Outbox(MemoryStore(), load_entry_points=False)\n"
        "bus = EventBus()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_load_app_returns_the_apps_own_outbox(module: str) -> None:
    outbox = load_app(f"{module}:outbox")
    assert isinstance(outbox, Outbox)
    assert outbox is sys.modules[module].outbox


@pytest.mark.parametrize(
    ("attribute", "fragment"),
    [
        ("bus", "is an EventBus, not an outboxkit.Outbox"),
        ("nope", "has no attribute 'nope'"),
        ("", "APP must be module:attribute"),
    ],
)
def test_load_app_says_what_load_object_says_as_wrong_input(
    module: str, attribute: str, fragment: str
) -> None:
    spec = f"{module}:{attribute}"
    with pytest.raises(LoadError) as loading:
        load_object(spec, what="APP", kind=Outbox)
    with pytest.raises(InputError) as caught:
        load_app(spec)
    assert caught.value.exit_code == WRONG_INPUT
    assert caught.value.format_message() == str(loading.value)
    assert fragment in str(loading.value)
