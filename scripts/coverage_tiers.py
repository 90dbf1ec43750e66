"""The figures of ``scripts/coverage.sh``: line coverage of ``sparktrain/`` in the quick tier
and in the full suite (the quick tier's data with the full-only tests' data), and how much of
what the full suite covers the quick tier covers too; then the files where the quick tier
misses most of what the full suite covers (what to test quickly next).

Example::

    .venv/bin/python scripts/coverage_tiers.py .coverage-data
"""
from __future__ import annotations

import os
import sys
from typing import Dict, Set

import coverage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "sparktrain")


def statements() -> Dict[str, Set[int]]:
    """``{path in sparktrain/: its statement lines}`` for every module of the package."""
    parser = coverage.Coverage(data_file=None, config_file=os.path.join(ROOT, "pyproject.toml"))
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[os.path.relpath(path, PACKAGE)] = set(parser.analysis2(path)[1])
    return found


def executed(data_file: str) -> Dict[str, Set[int]]:
    """``{path in sparktrain/: lines run}`` from a combined data file (paths from anywhere:
    the checkout, another clone, an installed copy)."""
    if not os.path.exists(data_file):
        return {}
    data = coverage.CoverageData(basename=data_file)
    data.read()
    found: Dict[str, Set[int]] = {}
    for measured in data.measured_files():
        _, sep, inside = measured.replace(os.sep, "/").rpartition("/sparktrain/")
        if sep or measured.startswith("sparktrain/"):
            key = inside if sep else measured[len("sparktrain/"):]
            found.setdefault(key, set()).update(data.lines(measured) or ())
    return found


def main(folder: str) -> int:
    lines = statements()
    total = sum(len(s) for s in lines.values())
    quick = executed(os.path.join(folder, "quick", ".coverage"))
    if not quick:
        print(f"no quick-tier data in {folder}/quick: run ./scripts/coverage.sh", file=sys.stderr)
        return 1
    only = executed(os.path.join(folder, "full-only", ".coverage"))

    def covered(runs: Dict[str, Set[int]]) -> Dict[str, Set[int]]:
        return {name: runs.get(name, set()) & stmts for name, stmts in lines.items()}

    quick_cov = covered(quick)
    n_quick = sum(len(s) for s in quick_cov.values())
    print(f"sparktrain/: {total} statements in {len(lines)} modules")
    print(f"quick tier: {n_quick} lines covered, {100 * n_quick / total:.1f} %")
    if not only:
        return 0
    full_cov = covered({name: quick.get(name, set()) | only.get(name, set()) for name in lines})
    n_full = sum(len(s) for s in full_cov.values())
    print(f"full suite: {n_full} lines covered, {100 * n_full / total:.1f} %")
    print(f"the quick tier covers {100 * n_quick / n_full:.1f} % of the lines the full suite "
          "covers")
    gaps = sorted(((len(full_cov[n] - quick_cov[n]), n) for n in lines), reverse=True)
    print("covered by the full suite only, most lines first:")
    for count, name in gaps[:15]:
        if count:
            print(f"  {count:5d}  sparktrain/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".coverage-data")))
