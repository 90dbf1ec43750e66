"""The class-data sharing archive local Spark JVMs start from (``session/jvm_archive.py``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sparktrain.session import jvm_archive


@pytest.fixture
def installs(tmp_path, monkeypatch):
    """A fake Java 17 and Spark (the files the archive's name depends on)."""
    java, spark = tmp_path / "java", tmp_path / "spark"
    (java / "lib").mkdir(parents=True)
    (java / "release").write_text('IMPLEMENTOR="x"\nJAVA_VERSION="17.0.15"\n')
    (java / "lib" / "modules").write_bytes(b"m" * 10)
    (spark / "jars").mkdir(parents=True)
    (spark / "jars" / "spark-core.jar").write_bytes(b"j" * 10)
    monkeypatch.setenv("JAVA_HOME", str(java))
    monkeypatch.setenv("SPARK_HOME", str(spark))
    return java, spark, str(tmp_path / "cache")


def test_the_archive_is_named_after_the_java_and_the_jars(installs):
    java, spark, cache = installs
    first = jvm_archive.archive_path(cache)
    assert first.startswith(cache) and first.endswith(".jsa")
    assert jvm_archive.archive_path(cache) == first
    (spark / "jars" / "spark-core.jar").write_bytes(b"j" * 11)  # Spark upgraded
    second = jvm_archive.archive_path(cache)
    assert second != first
    (java / "lib" / "modules").write_bytes(b"m" * 11)  # Java upgraded
    assert jvm_archive.archive_path(cache) not in (first, second)


@pytest.mark.parametrize("release, usable", [('"1.8.0_402"', False), ('"11.0.22"', False),
                                             ('"13"', True), ('"21.0.5"', True)])
def test_only_java_13_and_later_get_an_archive(installs, release, usable):
    java, _, cache = installs
    (java / "release").write_text(f"JAVA_VERSION={release}\n")
    assert (jvm_archive.archive_path(cache) is not None) == usable


def test_options_name_the_archive_only_once_it_exists(installs):
    _, _, cache = installs
    assert jvm_archive.java_options(cache) == ""
    assert jvm_archive.driver_conf({"a": "b"}, cache) == {"a": "b"}
    path = jvm_archive.archive_path(cache)
    os.makedirs(os.path.dirname(path))
    open(path, "wb").close()
    assert jvm_archive.java_options(cache).startswith(f"-XX:SharedArchiveFile={path} ")
    conf = jvm_archive.driver_conf({jvm_archive.DRIVER_OPTIONS: "-Dx=1"}, cache)
    assert conf[jvm_archive.DRIVER_OPTIONS] == f"{jvm_archive.java_options(cache)} -Dx=1"
    # a user's own archive options are left as they are
    own = "-XX:SharedArchiveFile=/elsewhere.jsa"
    assert jvm_archive.driver_conf({jvm_archive.DRIVER_OPTIONS: own}, cache) == \
        {jvm_archive.DRIVER_OPTIONS: own}


@pytest.mark.stack
@pytest.mark.timeout(300)
def test_local_spark_maps_spark_classes_from_the_archive(tmp_path):
    """A session from ``local_spark`` loads SparkContext from the archive (the JVM's class
    loading log says where each class came from), not from spark-core's jar."""
    if not os.path.isfile(jvm_archive.archive_path() or ""):
        jvm_archive.build()  # scripts/setup.sh builds it; a bare checkout builds it here
    log = tmp_path / "classes.log"
    code = textwrap.dedent(f"""
        from sparktrain import local_spark
        spark = local_spark("local[1]", conf={{
            "spark.driver.extraJavaOptions": "-Xlog:class+load=info:file={log}"}})
        assert spark.range(10).count() == 10
        spark.stop()
    """)
    env = dict(os.environ)
    env.pop("JAVA_TOOL_OPTIONS", None)  # the tests' own archive option: local_spark's counts
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=240)
    loaded = [line for line in log.read_text().splitlines()
              if "org.apache.spark.SparkContext " in line]
    assert loaded and "shared objects file (top)" in loaded[0], loaded


def test_archives_of_removed_installations_are_pruned(installs, tmp_path):
    _, spark, cache = installs
    os.makedirs(cache)
    kept, gone = os.path.join(cache, "spark-a.jsa"), os.path.join(cache, "spark-b.jsa")
    for path, home in ((kept, str(spark)), (gone, str(tmp_path / "deleted-venv"))):
        open(path, "wb").close()
        with open(path + ".json", "w") as f:
            json.dump({"spark_home": home, "java_home": str(tmp_path)}, f)
    jvm_archive._prune(cache)
    assert sorted(os.listdir(cache)) == ["spark-a.jsa", "spark-a.jsa.json"]
