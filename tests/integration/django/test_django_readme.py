"""The README's Django section is the tests' own project: its files are the project's files,
which the Django suite runs on SQLite and PostgreSQL (``test_django_project.py``)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.docs import page

HERE = Path(__file__).resolve().parent
SECTION = page("how-to/django.md")
FILES = {
    "# shop/models.py": HERE / "shop" / "models.py",
    "# shop/events.py": HERE / "shop" / "events.py",
    "# shop/services.py": HERE / "shop" / "services.py",
    "# tests/test_orders.py": HERE / "suite" / "test_orders.py",
}


def blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", SECTION, flags=re.S)


def test_the_readme_files_are_the_tested_project_files():
    shown = {}
    for block in blocks("python"):
        header = block.splitlines()[0]
        key = next((k for k in FILES if header.startswith(k)), None)
        if key is not None:
            shown[key] = block
    assert sorted(shown) == sorted(FILES)
    for key, path in FILES.items():
        assert shown[key] == path.read_text(encoding="utf-8"), f"README block {key} differs"


def test_the_readme_settings_and_conftest_are_the_projects():
    settings = (HERE / "project" / "settings.py").read_text(encoding="utf-8")
    conftest = (HERE / "conftest.py").read_text(encoding="utf-8")
    (settings_block,) = [b for b in blocks("python") if b.startswith("# settings.py")]
    (conftest_block,) = [b for b in blocks("python") if b.startswith("# conftest.py")]
    outboxkit_line = next(line for line in settings_block.splitlines() if "OUTBOXKIT =" in line)
    assert outboxkit_line in settings
    assert '"outboxkit.contrib.django"' in settings_block
    assert '"outboxkit.contrib.django"' in settings
    import_line = conftest_block.splitlines()[1]
    assert import_line.strip() in conftest


def test_the_readme_commands_are_the_manage_py_commands():
    from outboxkit.contrib.django.management.commands.outboxkit import COMMANDS

    (commands,) = blocks("bash")
    used = set(re.findall(r"manage\.py outboxkit (\w+)", commands))
    assert used <= set(COMMANDS)
    assert "run" in used


def user_project(tmp_path):
    """The page's project as a user lays it out: the tests' ``shop`` app and settings module
    (``project.settings`` standing for the page's ``myproject.settings``), ``manage.py``, and
    the page's own ``pytest.ini``, ``conftest.py`` and ``tests/test_orders.py``."""
    root = tmp_path / "site"
    root.mkdir()
    for name in ("project", "shop"):
        shutil.copytree(HERE / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HERE / "manage.py", root / "manage.py")
    (ini,) = blocks("ini")
    assert "DJANGO_SETTINGS_MODULE = myproject.settings" in ini
    (root / "pytest.ini").write_text(
        ini.replace("myproject.settings", "project.settings") + "filterwarnings = error\n",
        encoding="utf-8",
    )
    for block in blocks("python"):
        name = block.splitlines()[0].split()[1]
        if name in ("conftest.py", "tests/test_orders.py"):
            (root / name).parent.mkdir(exist_ok=True)
            (root / name).write_text(block, encoding="utf-8")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_", "DJANGO_SETTINGS"))
    }
    env.update(OUTBOXKIT_DJANGO_BACKEND="sqlite", OUTBOXKIT_DJANGO_NAME=str(tmp_path / "shop.db"))
    return root, env


def run_in(root, env, *args):
    """``python ARGS`` in the user's project, its output captured."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_pages_ini_conftest_and_tests_pass_as_a_user_lays_them_out(tmp_path):
    root, env = user_project(tmp_path)
    # pytest-asyncio, installed here for other tests, is no plugin the page's project uses
    result = run_in(
        root, env, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:asyncio", "tests"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("2 passed"), result.stdout


def test_the_pages_commands_run_in_the_project(tmp_path):
    """Each ``manage.py`` line of the page, as written; ``outboxkit run`` (until a signal) until
    idle instead. An order placed in between is delivered by it."""
    root, env = user_project(tmp_path)

    def manage(line):
        args = line.split("#", 1)[0].split()
        assert args[:2] == ["python", "manage.py"], line
        if args[2:4] == ["outboxkit", "run"] and "--until-idle" not in args:
            args.append("--until-idle")
        return run_in(root, env, *args[1:])

    (commands,) = blocks("bash")
    migrate, *outboxkit = [line for line in commands.splitlines() if line.strip()]
    assert manage(migrate).returncode == 0
    placed = run_in(
        root,
        {**env, "DJANGO_SETTINGS_MODULE": "project.settings"},
        "-c",
        "import django; django.setup()\n"
        "from shop.services import place_order\n"
        "print(place_order('book').id)\n",
    )
    assert placed.returncode == 0, placed.stderr
    outputs = []
    for line in outboxkit:
        result = manage(line)
        assert result.returncode == 0, f"{line}\n{result.stdout}{result.stderr}"
        outputs.append(result.stdout + result.stderr)
    assert "1 published" in outputs[0], outputs[0]  # the first run delivered the order's event
    assert "published" in outputs[-1].lower(), outputs[-1]  # status counts it
