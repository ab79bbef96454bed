"""The worked example of "Writing a store" (``examples/dictstore``): written on the public seam
alone, the twelve required methods and nothing more, and it passes ``outboxkit conformance`` as
a store author runs it."""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
from pathlib import Path

from outboxkit.storekit import StoreBase
from tests.docs import ROOT, blocks, page

EXAMPLE = ROOT / "examples" / "dictstore"


def test_the_example_store_passes_outboxkit_conformance_as_its_page_says() -> None:
    """The page's command, run where it says (``cd examples/dictstore``), prints what the page
    shows: the declared capabilities and the counts."""
    command, _ = blocks(page("writing-a-store.md"), "bash")
    change_dir, conformance = command.strip().splitlines()
    assert change_dir == "cd examples/dictstore"
    program, *args = shlex.split(conformance)
    assert program == "outboxkit" and args == ["conformance", "dictstore:make_store"]
    shown = blocks(page("writing-a-store.md"), "text")[0].strip().splitlines()
    outboxkit = Path(sys.executable).with_name("outboxkit")
    result = subprocess.run(
        [str(outboxkit), *args, "-p", "no:cacheprovider"],
        cwd=ROOT / change_dir.split()[1],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    printed = result.stdout.strip().splitlines()
    version = shown[0].split()[3]  # the suite's version, whatever the page shows
    assert printed[0] == shown[0].replace(version, printed[0].split()[3])
    assert shown[1] in printed, printed[:3]  # the declared capabilities
    assert printed[-1] == shown[-1]  # the counts: the skips are what it does not declare


def test_the_example_store_uses_the_public_seam_only_and_writes_the_twelve_methods() -> None:
    tree = ast.parse((EXAMPLE / "dictstore.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            assert node.module is not None
            assert not any(part.startswith("_") for part in node.module.split(".")), node.module
            assert not any(alias.name.startswith("_") for alias in node.names), node.module
    (store,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DictStore"]
    public = {
        f.name for f in store.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
    }
    assert public == set(StoreBase.__abstractmethods__)
    assert len(public) == 12
