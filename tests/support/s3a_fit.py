"""S3 as its users read it, run by tests/test_s3.py in a process of its own (one SparkContext
with Spark's s3a:// filesystem on its classpath): a Parquet table written and read by Spark on
``s3a://``, a materialized fit on it (Spark writes the dataset to the store's ``s3a://`` URL, the
ranks read it and checkpoint through s3fs on ``s3://``), then predictions. The credentials come
from the environment only (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, as S3 users set them):
Spark copies them into ``fs.s3a.*``, s3fs (botocore) reads them itself.

    python tests/support/s3a_fit.py ENDPOINT JARS_DIR  # "RESULT {json}" last
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


def main(endpoint: str, jars: str) -> dict:
    import numpy as np
    import s3fs

    from sparktrain import Store, local_spark
    from support.helpers import linear_estimator

    region = {"client_kwargs": {"endpoint_url": endpoint, "region_name": "eu-west-1"}}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **region)  # keys from the environment
    for bucket in ("sparktrain-data", "sparktrain-store"):
        fs.mkdir(bucket)
    spark = local_spark("local[2]", "sparktrain-s3a", conf={
        "spark.jars": ",".join(sorted(glob.glob(os.path.join(jars, "*.jar")))),
        "spark.hadoop.fs.s3a.endpoint": endpoint,
        "spark.hadoop.fs.s3a.endpoint.region": "eu-west-1",
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": "false"})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    table = "s3a://sparktrain-data/regression.parquet"
    started = time.time()
    spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y, strict=True)],
                          "features array<double>, label double").repartition(2) \
        .write.mode("overwrite").parquet(table)
    df = spark.read.parquet(table)
    written = time.time() - started
    store = Store.create("s3://sparktrain-store/st", storage_options=region)
    started = time.time()
    model = linear_estimator(store, epochs=4, batch_size=50, run_id="from-s3a").fit(df)
    fitted = time.time() - started
    scored = model.transform(df).select("label", "label__output").toPandas()
    found = {"table_rows": df.count(), "write_read_seconds": round(written, 1),
             "fit_seconds": round(fitted, 1), "history": model.getHistory()["loss"],
             "mse": float(((scored["label"] - scored["label__output"]) ** 2).mean()),
             "store": sorted(p.split("/st/", 1)[-1] for p in fs.find("sparktrain-store/st")),
             "table": sorted(p.rsplit("/", 1)[-1] for p in fs.find("sparktrain-data"))}
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    found["secret_in"] = [p for p in fs.find("sparktrain-store") if secret in fs.cat_file(p)]
    found["secret_in_repr"] = secret.decode() in repr(store)
    spark.stop()
    return found


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
