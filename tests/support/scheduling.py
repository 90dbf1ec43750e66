"""How pytest-xdist deals the suite to its two workers: whole files (``--dist loadfile``), except
that the files sharing a server fixture go to one worker together, so each server starts once
per run instead of once per worker that meets one of its files.

xdist's controller does not collect (it sees node ids only), so the groups are a static table;
a file outside it is its own unit. ``--dist loadgroup`` would do this with marks, but under
pytest 9.2 xdist 3.8's group mark changes nothing (it renames ``item._nodeid``, which pytest 9 no
longer reads): this scheduler does not depend on it.

Example: ``unit_of("tests/test_jobs.py::test_demo") == "connect_server"``.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

# the session fixtures in tests/support/servers.py and slot_host.py, and the files using them
SERVER_GROUPS: Dict[str, Tuple[str, ...]] = {
    "connect_server": ("test_connect.py", "test_jobs.py", "test_mlflow.py"),
    "standalone": ("test_driver_death.py", "test_elastic_cluster.py", "test_gpu_clusters.py",
                   "test_standalone_cluster.py"),
    "slot_host": ("test_concurrency.py", "test_parameter_server.py"),
}
_GROUP_OF = {name: group for group, files in SERVER_GROUPS.items() for name in files}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its server group, else its file."""
    path = nodeid.split("::", 1)[0]
    return _GROUP_OF.get(os.path.basename(path), path)


def unit_seconds(file_seconds: Dict[str, float]) -> Dict[str, float]:
    """Seconds per unit (``unit_of`` of a file name) from seconds per file."""
    found: Dict[str, float] = {}
    for name, seconds in file_seconds.items():
        found[unit_of(name)] = found.get(unit_of(name), 0.0) + seconds
    return found


def make_scheduler(config, log):
    """The scheduler for ``--dist loadfile`` (see the module docstring); ``None`` otherwise."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ServerGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ServerGroupScheduling(config, log)
