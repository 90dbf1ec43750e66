"""Seconds each test file takes, summed from a ``pytest --durations=0`` report, written to
``tests/durations.json``: conftest.py hands files to the two workers longest first from it.

Refresh it after a change that moves the times (run on the 2-core machine, both workers)::

    .venv/bin/python -m pytest tests --durations=0 -p no:cacheprovider > /tmp/d.log
    .venv/bin/python tests/support/durations.py /tmp/d.log     # rewrites tests/durations.json
"""
from __future__ import annotations

import json
import os
import re
import sys
from collections import defaultdict
from typing import Dict, Iterable

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "durations.json")
_LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(?:tests/)?(test_[\w]+\.py)::")


def per_file(lines: Iterable[str]) -> Dict[str, float]:
    """``{"test_x.py": seconds}`` from a durations report's lines (setup, call and teardown).

    Example: ``per_file(["3.50s call     tests/test_x.py::test_a"]) == {"test_x.py": 3.5}``
    """
    found: Dict[str, float] = defaultdict(float)
    for line in lines:
        match = _LINE.match(line)
        if match:
            found[match.group(2)] += float(match.group(1))
    return {name: round(seconds) for name, seconds in
            sorted(found.items(), key=lambda item: -item[1])}


def load() -> Dict[str, float]:
    """The checked-in table (empty when there is none: then collection order is kept)."""
    try:
        with open(PATH) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


if __name__ == "__main__":
    with open(sys.argv[1], errors="replace") as report:
        table = per_file(report)
    with open(PATH, "w") as out:
        json.dump(table, out, indent=0)
        out.write("\n")
    print(f"{len(table)} files, {sum(table.values()):.0f} s in all -> {PATH}")
