"""The two layout rules import-linter's contracts (pyproject.toml) do not state; `make lint` runs this.

- No import cycle between modules. An import under `if TYPE_CHECKING:` is for the type checker and does not count;
  an import inside a function does: it only defers the cycle to the first call.
- At most a dozen modules at gateway/'s root: every other module lives in a package named for its concern
  (CONTRIBUTING.md's "Where things are").
"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "backend_engine")
ROOT_MODULES_AT_MOST = 12


def import_cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """One cycle (its shortest) per set of modules that import each other, at run time."""
    cycles: dict[frozenset[str], tuple[str, ...]] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycle = (importer, *back)
                cycles.setdefault(frozenset(cycle), cycle)
    return list(cycles.values())


def main() -> int:
    sys.path.insert(0, str(REPO))  # this checkout's packages, whichever an installed one names
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)
    failed = False
    for cycle in import_cycles(graph):
        print(f"import cycle: {' -> '.join(cycle)}")
        failed = True
    root = sorted(path.name for path in (REPO / "gateway").glob("*.py"))
    if len(root) > ROOT_MODULES_AT_MOST:
        print(f"gateway/ holds {len(root)} modules at its root, more than {ROOT_MODULES_AT_MOST}: {' '.join(root)}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
