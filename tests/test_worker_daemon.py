"""Python workers fork from sparktrain's preloading daemon (sparktrain.session.worker_daemon)."""
import pandas as pd
import pytest

from sparktrain.session import worker_daemon


@pytest.mark.stack  # runs pyspark.daemon, whose arguments differ between Spark versions
def test_python_workers_fork_from_the_preloading_daemon(spark):
    assert spark.conf.get("spark.python.daemon.module") == "sparktrain.session.worker_daemon"

    def probe(batches):
        import os
        import sys

        with open(f"/proc/{os.getppid()}/cmdline") as f:
            parent = f.read().replace("\0", " ")
        preloaded = all(name in sys.modules for name in ("torch", "pyarrow", "pandas"))
        for _ in batches:
            yield pd.DataFrame({"parent": [parent], "preloaded": [preloaded]})

    rows = spark.range(4).repartition(2).mapInPandas(probe, "parent string, preloaded boolean") \
        .collect()
    assert rows and all("sparktrain.session.worker_daemon" in r.parent for r in rows), rows
    assert all(r.preloaded for r in rows)


def test_preload_imports_what_is_installed_and_skips_the_rest():
    import sys

    sys.modules.pop("colorsys", None)
    worker_daemon.preload(["surely_not_an_installed_module", "colorsys"])
    assert "colorsys" in sys.modules
