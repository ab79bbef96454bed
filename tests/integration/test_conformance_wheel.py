"""Acceptance for the conformance suite as a third party meets it: built wheel, fresh venv; and
what the wheel installs: exactly outboxkit's five top-level packages, the demo among them."""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_IN_THE_COPY = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    "*.db",
    "*.db-wal",
    "*.db-shm",
)
PACKAGES = {  # the top-level packages the wheel installs, and their folders in the source tree
    "outboxkit": ROOT / "outboxkit",
    "outboxkit_pg": ROOT / "outboxkit_pg",
    "outboxkit_sqlite": ROOT / "outboxkit_sqlite",
    "outboxkit_mysql": ROOT / "outboxkit_mysql",
    "outboxkit_conformance": ROOT / "conformance" / "outboxkit_conformance",
}

THIRD_PARTY_STORE = '''
"""A third party's store: the memory store wrapped, plus a broken variant and one without an
asyncio side."""
import dataclasses

from outboxkit import ConfigurationError, MemoryStore


class WrappedStore:
    """Delegates everything to a MemoryStore, as a user's adapter would."""

    def __init__(self):
        self._inner = MemoryStore()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def capabilities(self):
        return self._inner.capabilities


class LeaseIgnoringStore(WrappedStore):
    """Broken on purpose: its claim ignores leases, so leased events are claimed again."""

    def claim(self, *, batch_size, lease, now):
        with self._inner._lock:
            for row in self._inner._events.values():
                row.locked_until = None
        return self._inner.claim(batch_size=batch_size, lease=lease, now=now)


class BlockingOnlyStore(WrappedStore):
    """Declares no asyncio side: the asyncio modes skip, saying so."""

    @property
    def capabilities(self):
        return dataclasses.replace(self._inner.capabilities, asyncio=False)

    def async_store(self):
        raise ConfigurationError("no asyncio side")


def make_store():
    return WrappedStore()


def make_blocking_store():
    return BlockingOnlyStore()


def make_broken_store(tmp_path):
    return LeaseIgnoringStore()
'''


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("build")
    dist = work / "dist"
    # From a copy of the tree (setuptools writes build/ and *.egg-info into the tree it builds,
    # and two xdist workers building one tree at once break each other's build), the sdist
    # first and the wheel from it: the wheel holds only what the project lists, never what an
    # earlier build left in a build/ folder.
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=SKIPPED_IN_THE_COPY)
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(source)],
        check=True,
        capture_output=True,
    )
    (built,) = dist.glob("outboxkit-*.whl")
    return built


@pytest.fixture(scope="module")
def venv_with_wheel(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(wheel), "pytest"],
        check=True,
        capture_output=True,
    )
    package = work / "thirdparty"
    package.mkdir()
    (package / "mystore.py").write_text(textwrap.dedent(THIRD_PARTY_STORE))
    return env_dir


def run_conformance(
    env_dir: Path, factory: str, *pytest_args: str
) -> subprocess.CompletedProcess[str]:
    cwd = env_dir.parent / "thirdparty"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    env["PYTHONPATH"] = str(cwd)
    return subprocess.run(
        [str(env_dir / "bin" / "outboxkit"), "conformance", factory, *pytest_args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def wheel_record(wheel: Path) -> list[str]:
    """The paths the wheel's RECORD lists: every file it installs."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
        with archive.open(name) as raw:
            rows = list(csv.reader(io.TextIOWrapper(raw, encoding="utf-8")))
        assert sorted(row[0] for row in rows) == sorted(archive.namelist())
    return [row[0] for row in rows]


@pytest.mark.slow
def test_wheel_installs_exactly_the_five_top_level_packages(wheel: Path) -> None:
    record = wheel_record(wheel)
    top_level = {path.split("/", 1)[0] for path in record}
    metadata = {name for name in top_level if name.endswith((".dist-info", ".data"))}
    assert metadata == {"outboxkit-0.1.0.dist-info"}, sorted(top_level)
    assert top_level - metadata == set(PACKAGES), sorted(top_level)
    # Every module of the source tree made it (the explicit packages list misses no subpackage).
    shipped = set(record)
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" not in path.parts:
                relative = path.relative_to(folder).as_posix()
                assert f"{package}/{relative}" in shipped, f"{package}/{relative}"
        assert f"{package}/py.typed" in shipped, package
    assert "outboxkit/cli/demo/app.py" in shipped


@pytest.mark.slow
def test_wheel_ships_the_suite_and_a_third_party_store_passes(venv_with_wheel: Path) -> None:
    result = run_conformance(venv_with_wheel, "mystore:make_store")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "outboxkit conformance suite 1.11.0 against mystore:make_store" in result.stdout
    assert (
        "declared capabilities: asyncio, batches, concurrent_batches, concurrent_claimers, "
        "dedupe, error_history, ordering, transactional_handlers" in result.stdout
    )
    summary = [line for line in result.stdout.splitlines() if line.startswith("conformance: ")]
    assert summary, result.stdout
    assert " 0 failed" in summary[0]
    passed = int(summary[0].split()[1])
    assert passed >= 40


@pytest.mark.slow
def test_a_store_without_an_asyncio_side_skips_the_asyncio_modes_saying_why(
    venv_with_wheel: Path,
) -> None:
    result = run_conformance(venv_with_wheel, "mystore:make_blocking_store", "-rs", "-k", "r9")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "declared capabilities: batches, concurrent_batches" in result.stdout
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED ")]
    reason = "store does not declare the 'asyncio' capability"
    assert len(skipped) == 1 and "3" in skipped[0].split()[1] and reason in skipped[0], skipped
    summary = [line for line in result.stdout.splitlines() if line.startswith("conformance: ")]
    assert summary and summary[0].startswith("conformance: 2 passed"), result.stdout


@pytest.mark.slow
def test_a_broken_store_fails_naming_the_tests(venv_with_wheel: Path) -> None:
    result = run_conformance(venv_with_wheel, "mystore:make_broken_store")
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    assert any("test_leased_event_is_not_claimed_again" in line for line in failed), result.stdout
    assert any("test_batch_limit_holds" in line for line in failed), result.stdout


@pytest.mark.slow
def test_a_bad_factory_is_a_usage_error(venv_with_wheel: Path) -> None:
    result = run_conformance(venv_with_wheel, "nosuchmodule:make")
    assert result.returncode == 2
    assert "cannot import 'nosuchmodule'" in result.stderr


@pytest.mark.slow
def test_wheel_ships_the_demo(venv_with_wheel: Path, tmp_path: Path) -> None:
    """the example shop is in the wheel, and ``outboxkit demo`` runs from it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    result = subprocess.run(
        [str(venv_with_wheel / "bin" / "outboxkit"), "demo", "--orders", "50"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "50 orders:" in result.stdout
    assert (tmp_path / "outboxkit-demo.db").is_file()
