"""Fixtures for the ``outboxkit`` command's tests.

- ``target``: the store a test works on, SQLite and PostgreSQL (``tests/backends.py``).
- ``store``: that store opened and migrated, for seeding and inspecting.
- ``app``: a test app module (``tests/cli/apps.py``) whose own store is the target.
- ``cli``: runs ``outboxkit ...`` through click's ``CliRunner`` or as a real subprocess
  (parametrized), returning the exit code, stdout and stderr.
- ``procs``: long-running ``outboxkit`` subprocesses; every one is bounded and killed at teardown.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import chdir, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from outboxkit import Store
from outboxkit.cli import cli as cli_group
from tests.backends import SQL_BACKENDS, Target, open_target

from .apps import App, write_app

TIMEOUT = 60.0  # the most any single command may take


def outboxkit_command() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m outboxkit``."""
    script = Path(sys.executable).with_name("outboxkit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outboxkit"]


@dataclass(frozen=True)
class Result:
    code: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


@dataclass
class Cli:
    """``outboxkit ARGS`` in one of two modes: ``runner`` (in process) or ``process``."""

    mode: str
    cwd: Path
    paths: list[Path] = field(default_factory=list)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
        env.update(extra or {})
        python_path = [str(p) for p in self.paths]
        if env.get("PYTHONPATH"):
            python_path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(python_path)
        return env

    def __call__(self, *args: str, env: dict[str, str] | None = None) -> Result:
        if self.mode == "runner":
            with chdir(self.cwd):
                result = CliRunner().invoke(cli_group, list(args), env=env, prog_name="outboxkit")
            stderr = result.stderr
            if result.exception is not None and not isinstance(result.exception, SystemExit):
                assert result.exc_info is not None
                stderr += "".join(traceback.format_exception(*result.exc_info))
            return Result(result.exit_code, result.stdout, stderr)
        done = subprocess.run(
            [*outboxkit_command(), *args],
            cwd=self.cwd,
            env=self.env(env),
            stdin=subprocess.DEVNULL,  # never the terminal pytest may run on
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        return Result(done.returncode, done.stdout, done.stderr)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OUTBOXKIT_STORE", "SHOP_DB", "OUTBOXKIT_SUPERVISOR_PID", "OUTBOXKIT_POLLER"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=SQL_BACKENDS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    with open_target(request.param, tmp_path) as target:
        yield target


@pytest.fixture
def store(target: Target) -> Iterator[Store]:
    store = target.open()
    try:
        store.migrate()
        yield store
    finally:
        store.close()


@pytest.fixture
def app(
    tmp_path: Path, target: Target, monkeypatch: pytest.MonkeyPatch, store: Store
) -> Iterator[App]:
    """A test app whose own store is the target (migrated first)."""
    written = write_app(tmp_path / "app")
    for name, value in target.app_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(str(written.folder))
    yield written
    module = sys.modules.pop(written.name, None)
    if module is not None:
        module.store.close()


@pytest.fixture(params=["runner", "process"])
def cli(request: pytest.FixtureRequest, tmp_path: Path) -> Cli:
    work = tmp_path / "cwd"
    work.mkdir()
    return Cli(request.param, work, [tmp_path / "app"])


@pytest.fixture
def process_cli(tmp_path: Path) -> Cli:
    """``outboxkit`` as a real subprocess only (for what a CliRunner cannot show)."""
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    return Cli("process", work, [tmp_path / "app"])


def on_a_terminal(cli: Cli, args: list[str]) -> tuple[int, str]:
    """Run ``outboxkit ARGS`` with stdout and stderr on a pseudo-terminal; its exit code and
    everything it wrote there."""
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [*outboxkit_command(), *args],
            cwd=cli.cwd,
            env=cli.env(),
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
        )
    finally:
        os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], deadline - time.monotonic())
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", errors="replace")


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Orchestration only: poll ``condition`` until it holds, failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


@dataclass
class Proc:
    """A running ``outboxkit`` subprocess with its stderr in a file."""

    popen: subprocess.Popen[bytes]
    stderr_path: Path
    stdout_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(encoding="utf-8", errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(encoding="utf-8", errors="replace")

    def wait_for_log(self, text: str, timeout: float = 30.0) -> None:
        try:
            wait_for(
                lambda: text in self.stderr() or self.popen.poll() is not None,
                f"{text!r} in the log",
                timeout,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.report()}") from None
        assert text in self.stderr(), self.report()

    def report(self) -> str:
        return f"exit {self.popen.poll()}\n--- stdout\n{self.stdout()}\n--- stderr\n{self.stderr()}"


class Procs:
    """Starts ``outboxkit`` subprocesses and makes sure none outlives the test."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Proc] = []

    def start(
        self,
        cli: Cli,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        sigint_ignored: bool = False,
    ) -> Proc:
        """``outboxkit ARGS`` in the background; ``sigint_ignored``: started with SIGINT
        ignored, as a non-interactive shell starts a background job."""
        n = len(self.started)
        command = [*outboxkit_command(), *args]
        if sigint_ignored:
            command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
        stderr_path = self.tmp_path / f"proc{n}.stderr"
        stdout_path = self.tmp_path / f"proc{n}.stdout"
        with stderr_path.open("wb") as err, stdout_path.open("wb") as out:
            popen = subprocess.Popen(
                command,
                cwd=cli.cwd,
                env=cli.env(env),
                stdout=out,
                stderr=err,
            )
        proc = Proc(popen, stderr_path, stdout_path)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        folder = self.tmp_path / "app"
        if folder.is_dir():
            (folder / "gate").touch()  # let blocked handlers return
        for proc in self.started:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait(timeout=TIMEOUT)
        # A supervisor's children sit in their own process groups and stop by themselves once
        # it is gone; kill any that has not, but only a process that is provably one of ours.
        ours = {f"OUTBOXKIT_SUPERVISOR_PID={proc.pid}".encode() for proc in self.started}
        for marker in folder.glob("started-*-*") if folder.is_dir() else ():
            _kill_if_ours(int(marker.name.rsplit("-", 1)[1]), ours)


def _kill_if_ours(pid: int, ours: set[bytes]) -> None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone already (or not inspectable here)
        return
    if ours.intersection(environ):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    running = Procs(tmp_path)
    try:
        yield running
    finally:
        running.close()
