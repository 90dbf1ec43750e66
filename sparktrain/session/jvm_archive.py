"""A class-data sharing archive of Spark's classes: local Spark JVMs start on half the CPU.

A Spark JVM spends most of its start loading, parsing and verifying thousands of classes from
Spark's jars. Java 13+ can write the classes a run loaded into an archive
(``-XX:ArchiveClassesAtExit``) that later JVMs map instead (``-XX:SharedArchiveFile``; JEP 350,
dynamic CDS archives). Measured on 2 cores: a ``local[2]`` session running two small jobs used
6.4-7.3 CPU-s of JVM, 3.3-3.5 with the archive, and started in 2.7 s instead of 4.1 s.

An archive fits one JVM and one class path: a JVM given another checks that and loads from the
jars as before. The archive's name is therefore a hash of the Java installation and of Spark's
jars (``~/.cache/sparktrain/jvm/spark-<hash>.jsa``, ~180 MiB), so an upgrade of either simply
finds none. It is built once, explicitly (``scripts/setup.sh`` does), and used by
:func:`sparktrain.local_spark` and :class:`sparktrain.session.ConnectServer` where it exists.

Example::

    python -m sparktrain.session.jvm_archive     # build it for this Java and Spark (~30 s)
    java_options()     # '-XX:SharedArchiveFile=/root/.cache/sparktrain/jvm/spark-1a2b.jsa ...'
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Mapping, Optional

CACHE_ENV = "SPARKTRAIN_JVM_ARCHIVE_DIR"
# A JVM whose class path differs from the archive's warns that it cannot use it and goes on
# without; that is expected (e.g. spark-submit's own launcher JVM), not worth a line.
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
DRIVER_OPTIONS = "spark.driver.extraJavaOptions"


def spark_home() -> str:
    """The Spark installation pyspark launches (``SPARK_HOME``, else pyspark's own)."""
    if os.environ.get("SPARK_HOME"):
        return os.environ["SPARK_HOME"]
    import pyspark

    return os.path.dirname(pyspark.__file__)


def java_home() -> Optional[str]:
    """``JAVA_HOME``, else the installation of the ``java`` on ``PATH`` (as spark-submit)."""
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    java = shutil.which("java")
    return os.path.dirname(os.path.dirname(os.path.realpath(java))) if java else None


def java_version(home: str) -> Optional[int]:
    """The feature version in ``home/release`` (``"17.0.15"`` → 17, ``"1.8.0_402"`` → 8)."""
    try:
        with open(os.path.join(home, "release")) as f:
            found = re.search(r'^JAVA_VERSION="(\d+)(?:\.(\d+))?', f.read(), re.M)
    except OSError:
        return None
    if not found:
        return None
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major


def archive_path(cache_dir: Optional[str] = None) -> Optional[str]:
    """Where the archive for this Java and Spark is (or would be); ``None`` where the JVM cannot
    use one (Java before 13, or no Java found)."""
    home = java_home()
    if home is None or (java_version(home) or 0) < 13:
        return None
    digest = hashlib.sha256()
    parts = [os.path.join(home, "release"), os.path.join(home, "lib", "modules")]
    parts += sorted(glob.glob(os.path.join(spark_home(), "jars", "*.jar")))
    for path in parts:
        try:
            stat = os.stat(path)
        except OSError:
            continue
        digest.update(f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    folder = cache_dir or os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "sparktrain", "jvm")
    return os.path.join(folder, f"spark-{digest.hexdigest()[:16]}.jsa")


def java_options(cache_dir: Optional[str] = None) -> str:
    """JVM options that map the archive where it exists for this Java and Spark, else ``""``."""
    path = archive_path(cache_dir)
    if path is None or not os.path.isfile(path):
        return ""
    return f"-XX:SharedArchiveFile={path} {QUIET}"


def driver_conf(conf: Mapping[str, str], cache_dir: Optional[str] = None) -> Dict[str, str]:
    """Spark ``conf`` whose driver JVM maps the archive (where one exists) before the user's
    own ``spark.driver.extraJavaOptions``; left as it is where those name an archive."""
    own = conf.get(DRIVER_OPTIONS, "")
    archive = java_options(cache_dir)
    if not archive or "SharedArchiveFile" in own or "ArchiveClassesAtExit" in own:
        return dict(conf)
    return {**conf, DRIVER_OPTIONS: f"{archive} {own}".strip()}


# What the archive's run does: what a fit asks of the driver (Arrow to and from pandas, Parquet
# written and read, a barrier stage, Python UDFs), so those classes are in it.
_WORKLOAD = r'''
import os, sys
from sparktrain.session import local_spark
spark = local_spark("local[2]", app_name="sparktrain-jvm-archive", conf={
    "spark.ui.enabled": "false",
    # C1 alone: this JVM lives seconds, and the archive holds classes, not compiled code
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:ArchiveClassesAtExit="
                                     + sys.argv[1]})
proc = spark.sparkContext._gateway.proc
data = os.path.join(sys.argv[2], "data")
df = spark.range(400).selectExpr("id", "cast(id as double) as x",
                                 "array(cast(id as float), 1.0f) as v", "id % 5 = 0 as is_val")
df.repartition(2).write.mode("overwrite").parquet(data)
back = spark.read.parquet(data)
spark.createDataFrame(back.toPandas()).groupBy("is_val").count().collect()
back.mapInPandas(lambda frames: frames, back.schema).count()
back.rdd.barrier().mapPartitions(lambda rows: [sum(1 for _ in rows)]).collect()
spark.stop()
proc.stdin.close()  # the JVM exits when its stdin closes, and writes the archive then
sys.exit(proc.wait(timeout=240))
'''


def build(path: Optional[str] = None, timeout: float = 300.0) -> str:
    """Write the archive (a short local Spark run that records the classes it loads); its path.
    Written beside and renamed, so a JVM never maps half an archive."""
    path = path or archive_path()
    if path is None:
        raise RuntimeError("no Java 13+ found (JAVA_HOME or java on PATH): the JVM cannot "
                           "write a class-data sharing archive")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    env = dict(os.environ, SPARKTRAIN_DAEMON_PRELOAD="")  # no torch: the JVM is what counts
    env.pop("JAVA_TOOL_OPTIONS", None)
    with tempfile.TemporaryDirectory(prefix="sparktrain-jvm-archive-") as scratch:
        run = subprocess.run([sys.executable, "-c", _WORKLOAD, partial, scratch], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=timeout)
    if run.returncode != 0 or not os.path.isfile(partial):
        if os.path.exists(partial):
            os.remove(partial)
        raise RuntimeError(f"the run writing the JVM class archive failed (exit "
                           f"{run.returncode}):\n{run.stdout[-3000:]}")
    os.replace(partial, path)
    with open(path + ".json", "w") as f:  # for pruning: whose archive it is
        json.dump({"spark_home": spark_home(), "java_home": java_home()}, f)
    _prune(os.path.dirname(path))
    return path


def _prune(folder: str) -> None:
    """Remove the archives of Spark or Java installations that are gone (a deleted venv)."""
    for meta in glob.glob(os.path.join(folder, "spark-*.jsa.json")):
        try:
            with open(meta) as f:
                homes = json.load(f)
        except (OSError, ValueError):
            continue
        if not all(os.path.isdir(home or "") for home in homes.values()):
            for stale in (meta[:-len(".json")], meta):
                if os.path.exists(stale):
                    os.remove(stale)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparktrain.session.jvm_archive",
        description="Build the class-data sharing archive local Spark JVMs start from.")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    parser.add_argument("--dir", help=f"where archives are kept (default ${CACHE_ENV} or "
                                      f"~/.cache/sparktrain/jvm)")
    args = parser.parse_args(argv)
    path = archive_path(args.dir)
    if path is None:
        print("sparktrain: no Java 13+ found; JVMs start without a class archive")
        return 1
    if os.path.isfile(path) and not args.force:
        print(f"sparktrain: JVM class archive already built: {path}")
        return 0
    print(f"sparktrain: building the JVM class archive for this Java and Spark (about 30 s, "
          f"once): {path}", flush=True)
    started = time.monotonic()
    build(path)
    print(f"sparktrain: JVM class archive built in {time.monotonic() - started:.0f} s: {path} "
          f"({os.path.getsize(path) / 2 ** 20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
