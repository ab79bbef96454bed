"""The worked example of "Writing a store" (``examples/dictstore``): written on the public seam
alone, the twelve required methods and nothing more, and it passes ``outboxkit conformance`` as
a store author runs it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from outboxkit.storekit import StoreBase

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dictstore"


def test_the_example_store_passes_outboxkit_conformance_as_its_readme_says() -> None:
    outboxkit = Path(sys.executable).with_name("outboxkit")
    result = subprocess.run(
        [str(outboxkit), "conformance", "dictstore:make_store", "-p", "no:cacheprovider"],
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("conformance: ") and " 0 failed" in summary, summary
    passed = int(summary.split()[1])
    assert passed >= 50, summary  # the skips are the capabilities it does not declare


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
