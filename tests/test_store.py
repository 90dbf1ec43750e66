from sparktrain.data.store import Store
from sparktrain.fs import to_fsspec_url, to_spark_url


def test_url_forms():
    assert to_fsspec_url("file:/tmp/x") == "/tmp/x"
    assert to_fsspec_url("file:///tmp/x") == "/tmp/x"
    assert to_fsspec_url("s3a://bucket/p") == "s3://bucket/p"
    assert to_fsspec_url("dbfs:/ml/st") == "/dbfs/ml/st"
    assert to_fsspec_url("hdfs://nn:8020/u") == "hdfs://nn:8020/u"
    assert to_spark_url("/tmp/x") == "file:///tmp/x"
    assert to_spark_url("s3://bucket/p") == "s3a://bucket/p"
    assert to_spark_url("dbfs:/ml/st") == "dbfs:/ml/st"


def test_store_paths_and_repr_hide_credentials():
    store = Store.create("s3a://bucket/root/", storage_options={"secret": "hunter2"})
    assert store.dataset_path("k") == "s3://bucket/root/datasets/k"
    assert store.spark_path("datasets", "k") == "s3a://bucket/root/datasets/k"
    assert store.run_path("r1") == "s3://bucket/root/runs/r1"
    assert "hunter2" not in repr(store)
    assert not store.is_local
    local = Store.create("relative/dir")
    assert local.is_local and local.prefix.startswith("/")


def test_store_rejects_other_types():
    import pytest

    with pytest.raises(TypeError, match="store must be a path/URL string"):
        Store.create(42)


def test_an_hdfs_store_without_a_client_says_what_to_install(monkeypatch):
    """Where fsspec's hdfs:// is pyarrow's client (hdfs-native not installed) and no libjvm or
    libhdfs can load, the error names both ways to reach HDFS."""
    import importlib

    import fsspec
    import pytest

    from sparktrain.fs import filesystem

    registry = importlib.import_module("fsspec.registry")
    monkeypatch.setitem(registry._registry, "hdfs", fsspec.get_filesystem_class("arrow_hdfs"))
    monkeypatch.setenv("JAVA_HOME", "/nonexistent")
    monkeypatch.delenv("ARROW_LIBHDFS_DIR", raising=False)
    with pytest.raises(RuntimeError, match=r"sparktrain\[hdfs\].*libhdfs"):
        filesystem("hdfs://localhost:1/user/me/store")


def test_hdfs_store_urls_are_resolved_with_the_drivers_hadoop_settings():
    """``hdfs:///p`` and HA nameservices mean the same in every process: the driver's
    settings travel in the URL and the storage options (the ranks need no HADOOP_CONF_DIR)."""
    from sparktrain.fs import client_package

    settings = {"fs.defaultFS": "hdfs://nn:8020"}
    assert Store("hdfs:///user/me/st").resolved(settings).prefix == "hdfs://nn:8020/user/me/st"
    assert Store("hdfs://other:9000/st").resolved(settings).prefix == "hdfs://other:9000/st"
    assert Store("hdfs:///st").resolved({}).prefix == "hdfs:///st"  # nothing to resolve with
    s3 = Store("s3a://b/st")
    assert s3.resolved(settings) is s3
    ha = {"fs.defaultFS": "hdfs://prod", "dfs.nameservices": "prod,backup",
          "dfs.ha.namenodes.prod": "nn1,nn2", "dfs.namenode.rpc-address.prod.nn1": "a:8020",
          "dfs.namenode.rpc-address.prod.nn2": "b:8020", "dfs.ha.namenodes.backup": "x"}
    store = Store("hdfs:///st", {"user": "me"}).resolved(ha)
    wanted = {key: value for key, value in ha.items()
              if key != "fs.defaultFS" and "backup" not in key}
    wanted["dfs.nameservices"] = "prod,backup"
    assert store.prefix == "hdfs://prod/st"
    options = store.storage_options
    if client_package("hdfs://prod/st") == "hdfs_native":  # Hadoop settings as its options
        assert options == {**wanted, "user": "me"}
    else:  # pyarrow's HadoopFileSystem takes them as extra_conf
        assert options == {"user": "me", "extra_conf": wanted}
