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
