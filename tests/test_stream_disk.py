"""input_mode="stream" with a local disk smaller than a rank's rows (a real tmpfs as
SPARK_LOCAL_DIRS, mounted by the test as root; a session of its own in a subprocess):
with a task slot left to feed the ranks the fit trains, reading the rows again each epoch;
where the ranks take every slot the full disk is one named error, not retried.

Full tier: its one test, test_rows_bigger_than_the_local_disk_still_train. Nothing in the quick
tier fills SPARK_LOCAL_DIRS, so only it catches fed ranks that keep more rows than that disk's
free space allows instead of reading them again, or a shuffle that fills it not turned into
one LocalDiskFullError naming it. test_row_feed.py's re-read shards get an explicit
cache_limit, and test_full_disk.py fills the store's disk, not Spark's local one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.full
def test_rows_bigger_than_the_local_disk_still_train(tmpfs, tmp_path):
    local = tmpfs("6m")  # a rank's rows: 7.5 MiB decoded
    env = dict(os.environ, SPARK_LOCAL_DIRS=str(local))
    done = subprocess.run([sys.executable, os.path.join(HERE, "support", "small_disk_stream.py"),
                           str(tmp_path / "store")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    loss = result["history"]["loss"]
    assert len(loss) == 2 and loss[1] < 0.5 * loss[0], loss
    assert result["every_slot"].startswith("LocalDiskFullError"), result["every_slot"]
    assert f"in {local}" in result["every_slot"] and "SPARK_LOCAL_DIRS" in result["every_slot"]
