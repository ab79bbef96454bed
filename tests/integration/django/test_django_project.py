"""Runs the Django tests (``suite/``) in a pytest of their own, configured by the tiny project
here (``project.settings``), once on a SQLite file and once on PostgreSQL: pytest-django becomes
active only there, so the rest of the suite runs as without it."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.integration.pg.conftest import pg_url_from_env, require_server

PROJECT = Path(__file__).resolve().parent
TIMEOUT = 600


def run_suite(backend, name, *args):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "OUTBOXKIT_DJANGO_BACKEND": backend,
        "OUTBOXKIT_DJANGO_NAME": name,
        "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT), os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "suite", *args],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    output = result.stdout + result.stderr
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    assert result.returncode == 0, output
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, output


def test_django_suite_on_a_sqlite_file(tmp_path):
    run_suite("sqlite", str(tmp_path / "django.db"))


def test_django_suite_on_pytest_djangos_default_in_memory_sqlite(tmp_path):
    # Django's default test database for SQLite is in memory: the test kit runs on it as on a
    # file. The process tests are left out: another process cannot reach an in-memory database.
    run_suite(
        "sqlite-memory", str(tmp_path / "django.db"), "--ignore=suite/test_django_processes.py"
    )


@pytest.mark.pg
def test_django_suite_on_postgresql():
    require_server(pg_url_from_env())
    run_suite("postgresql", f"okdj_{uuid.uuid4().hex[:12]}")
