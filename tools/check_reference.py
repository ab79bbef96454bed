"""Check that the built documentation site has a reference entry for every public name.

Run after ``mkdocs build`` (``.ci/run`` does): reads the site's ``objects.inv`` (the inventory
mkdocstrings writes) and fails, naming them, when a name of a public module's ``__all__`` has
no entry. Usage: ``python tools/check_reference.py [site]``.
"""

from __future__ import annotations

import importlib
import sys
import zlib
from pathlib import Path

MODULES = (
    "outboxkit",
    "outboxkit.testing",
    "outboxkit.storekit",
    "outboxkit.storekit.sql",
    "outboxkit.storekit.aiosql",
    "outboxkit.errors",
    "outboxkit.hookspecs",
    "outboxkit.observers",
    "outboxkit.core.options",
    "outboxkit.relay",
    "outboxkit.relay.inbox",
    "outboxkit.contrib.django",
    "outboxkit.contrib.sqlalchemy",
    "outboxkit.contrib.otel",
    "outboxkit.contrib.prometheus",
    "outboxkit.contrib.web",
    "outboxkit_pg",
    "outboxkit_sqlite",
    "outboxkit_mysql",
    "outboxkit_conformance",
)


# A public name whose entry lives under another path, with the reason.
ELSEWHERE = {
    # The function shares its name with its module (``outboxkit/contrib/django/store.py``),
    # which takes the package attribute's path in the documentation.
    "outboxkit.contrib.django.store": "outboxkit.contrib.django.store.store",
}


def inventory(site: Path) -> set[str]:
    """The names in the site's Sphinx-format inventory."""
    raw = (site / "objects.inv").read_bytes()
    body = raw.split(b"\n", 4)[4]  # four header lines, then the zlib stream
    names: set[str] = set()
    for line in zlib.decompress(body).decode("utf-8").splitlines():
        names.add(line.split(" ", 1)[0])
    return names


def public_names(module: str) -> list[str]:
    try:
        mod = importlib.import_module(module)
    except ImportError:  # an optional store package that is not there
        return []
    return [name for name in getattr(mod, "__all__", ()) if not name.startswith("__")]


def missing(site: Path) -> list[str]:
    """``module.name`` for every public name with no entry under that path."""
    names = inventory(site)
    lost: list[str] = []
    for module in MODULES:
        for name in public_names(module):
            path = f"{module}.{name}"
            if path not in names and ELSEWHERE.get(path) not in names:
                lost.append(f"{module}.{name}")
    return lost


def main() -> int:
    site = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("site")
    lost = missing(site)
    if lost:
        print(f"{len(lost)} public names have no reference entry:", *lost, sep="\n  ")
        return 1
    print(f"every public name of {len(MODULES)} modules has a reference entry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
