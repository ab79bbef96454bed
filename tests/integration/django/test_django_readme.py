"""The README's Django section is the tests' own project: its files are the project's files,
which the Django suite runs on SQLite and PostgreSQL (``test_django_project.py``)."""

import re
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
