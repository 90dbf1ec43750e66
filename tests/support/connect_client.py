"""A Spark Connect client, run in its own process by tests/test_connect.py.

    python tests/support/connect_client.py SCENARIO[,SCENARIO...] sc://127.0.0.1:PORT WORKDIR

The session starts exactly as a user starts it (``SparkSession.builder.remote(url)
.getOrCreate()``); each scenario uses sparktrain as the README shows and gives one JSON line of
findings (several scenarios run one after the other in this one process: :func:`main`). A
separate process because pyspark switches a whole process to Connect mode
(``SPARK_CONNECT_MODE_ENABLED``) once a remote session exists, and the main test process keeps a
classic session.
"""
from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Dict

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # support.*, sparktrain
#: a scenario still running after this long prints every thread's stack and exits (before
#: test_connect's own limit, so that the test shows where it hung)
HANG_SECONDS = 420
#: the README flow's epochs (torch and Keras): the fewest that reach its accuracy, with margin
README_EPOCHS = 5


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def _digits(spark):
    from jobs.common import digits_frame

    train, test = digits_frame(spark).randomSplit([0.8, 0.2], seed=3)
    return train.cache(), test.cache()


def _correct(predictions) -> float:
    import numpy as np

    frame = predictions.select("label", "label__output").toPandas()
    guesses = np.stack(frame["label__output"].to_numpy()).argmax(axis=1)
    return float((guesses == frame["label"].to_numpy()).mean())


def readme(spark, workdir: str) -> Dict[str, Any]:
    """The README's flow: Pipeline fit, transform, PipelineModel save/load, CrossValidator,
    KerasEstimator."""
    import numpy as np
    import torch
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from sparktrain import KerasEstimator, TorchEstimator, TorchModel
    from support.helpers import linear_estimator

    store = os.path.join(workdir, "store")
    train, test = _digits(spark)
    pixel_cols = [c for c in train.columns if c != "label"]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    est = TorchEstimator(num_proc=2, model=net,
                         optimizer=torch.optim.Adam(net.parameters(), lr=3e-3),
                         loss=torch.nn.CrossEntropyLoss(), metrics=[accuracy],
                         feature_cols=["features"], label_cols=["label"], batch_size=64,
                         epochs=README_EPOCHS, validation=0.1, store=store, verbose=1)
    assembler = VectorAssembler(inputCols=pixel_cols, outputCol="raw")
    scaler = StandardScaler(inputCol="raw", outputCol="features")
    model = Pipeline(stages=[assembler, scaler, est]).fit(train)
    found: Dict[str, Any] = {"history": model.stages[-1].getHistory()}
    found["torch_accuracy"] = _correct(model.transform(test))
    path = os.path.join(workdir, "digits model")  # a space: saved paths are URIs to Spark
    model.write().overwrite().save(path)
    model.write().overwrite().save(path)  # overwrite an existing one
    reloaded = PipelineModel.load(path)
    found["reloaded_is_torch_model"] = isinstance(reloaded.stages[-1], TorchModel)
    found["reloaded_accuracy"] = _correct(reloaded.transform(test))
    # the estimator and the bare model, saved and loaded on their own
    est.write().overwrite().save(os.path.join(workdir, "estimator"))
    loaded_est = TorchEstimator.load(os.path.join(workdir, "estimator"))
    found["estimator_reloaded"] = [loaded_est.uid == est.uid, loaded_est.getEpochs(),
                                   bool(torch.equal(loaded_est.getModel()[0].weight,
                                                    est.getModel()[0].weight))]
    model.stages[-1].write().overwrite().save(os.path.join(workdir, "torch-model"))
    bare = TorchModel.load(os.path.join(workdir, "torch-model"))
    scaled = Pipeline(stages=[assembler, scaler]).fit(train).transform(test)
    found["bare_model_accuracy"] = _correct(bare.transform(scaled))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    regression = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y, strict=True)],
                                       "features array<double>, label double")
    linear = linear_estimator(store, epochs=1, batch_size=64)
    grid = ParamGridBuilder().addGrid(linear.epochs, [1, 4]).build()
    cv = CrossValidator(estimator=linear, estimatorParamMaps=grid, numFolds=2, seed=5,
                        evaluator=RegressionEvaluator(predictionCol="label__output"))
    found["cv_metrics"] = list(cv.fit(regression).avgMetrics)

    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    k_model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    k_est = KerasEstimator(num_proc=2, model=k_model, optimizer=keras.optimizers.Adam(3e-3),
                           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           feature_cols=["features"], label_cols=["label"], batch_size=64,
                           epochs=README_EPOCHS, store=store, verbose=1)
    k_fitted = Pipeline(stages=[assembler, scaler, k_est]).fit(train)
    found["keras_accuracy"] = _correct(k_fitted.transform(test))
    k_path = os.path.join(workdir, "keras-model")
    k_fitted.write().overwrite().save(k_path)
    found["keras_reloaded_accuracy"] = _correct(PipelineModel.load(k_path).transform(test))
    return found


class FailOnRankOne:
    """A transformation_fn raising the user's own error on rank 1."""

    def __call__(self, batch):
        from pyspark import BarrierTaskContext

        if BarrierTaskContext.get().partitionId() == 1:
            raise ValueError("user error on rank one, over Spark Connect")
        return batch


class _ClientSide:
    """What a Connect client must never have, watched while a scenario runs: a listening socket
    (the executors cannot reach a laptop or a notebook: nothing may wait for them to call
    back), a JVM child process, a SparkContext or a py4j gateway (no RDD, no py4j on the
    client). ``report()`` gives what was seen since ``start()``."""

    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.listening: set = set()
        self.children: set = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        import psutil

        while not self.stop.is_set():
            self.listening |= {str(c.laddr) for c in self.process.net_connections(kind="inet")
                               if c.status == psutil.CONN_LISTEN}
            for child in self.process.children(recursive=True):
                try:
                    self.children.add(" ".join(child.cmdline()[:2]))
                except psutil.Error:  # ended meanwhile
                    pass
            time.sleep(0.2)

    def start(self) -> "_ClientSide":
        self.thread.start()
        return self

    def report(self) -> Dict[str, Any]:
        from pyspark import SparkContext

        self.stop.set()
        self.thread.join()
        return {"listening": sorted(self.listening), "children": sorted(self.children),
                "spark_context": SparkContext._active_spark_context is not None,
                "py4j_gateway": SparkContext._gateway is not None}


def faults(spark, workdir: str) -> Dict[str, Any]:
    """What over Connect differs from a classic session when a fit goes wrong: a killed rank's
    job fails as a gRPC error (still classed a fault: retried, resumed, the retry announced
    live), a rank's own error arrives with its traceback (not retried), and TFoS, which needs
    a SparkContext, is refused before any job. The client's sockets are watched for the whole
    process (:class:`_ClientSide`)."""
    import numpy as np

    from sparktrain import KerasEstimator, TrainingError
    from support.helpers import KillRankOnce, linear_estimator

    store = os.path.join(workdir, "store")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y, strict=True)],
                               "features array<double>, label double").cache()
    found: Dict[str, Any] = {}
    marker = os.path.join(workdir, "killed")
    model = linear_estimator(store, batch_size=100, epochs=4, run_id="connect-kill", verbose=1,
                             transformation_fn=KillRankOnce(marker, 24)).fit(df)
    found["killed"] = os.path.exists(marker)
    found["resumed_history"] = model.getHistory()["loss"]

    try:
        linear_estimator(store, epochs=1, transformation_fn=FailOnRankOne(),
                         max_attempts=1).fit(df)
    except TrainingError as error:
        found["user_error"] = {"rank": error.rank, "message": str(error),
                               "attempts": error.attempts}

    import keras

    started = time.time()
    try:
        KerasEstimator(num_proc=2, model=keras.Sequential([keras.Input((4,)),
                                                            keras.layers.Dense(1)]),
                       optimizer="sgd", loss="mse", feature_cols=["features"],
                       label_cols=["label"], backend="tfos", store=store).fit(df)
    except ValueError as error:
        found["tfos"] = {"message": str(error), "seconds": time.time() - started}
    return found


def horovod(spark, workdir: str) -> Dict[str, Any]:
    """backend='horovod' over Connect (its rendezvous server runs on rank 0's executor)."""
    import numpy as np

    from support.helpers import linear_estimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y, strict=True)],
                               "features array<double>, label double")
    model = linear_estimator(os.path.join(workdir, "store"), backend="horovod", epochs=3,
                             batch_size=50).fit(df)
    return {"history": model.getHistory()["loss"]}


def stream(spark, workdir: str) -> Dict[str, Any]:
    """input_mode='stream' over Connect: the barrier stage reads the DataFrame's rows, nothing
    goes to the store."""
    import numpy as np

    from support.helpers import linear_estimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y, strict=True)],
                               "features array<double>, label double")
    store = os.path.join(workdir, "store")
    model = linear_estimator(store, input_mode="stream", validation=0.2, epochs=3,
                             batch_size=50).fit(df)
    datasets = os.path.join(store, "datasets")
    return {"history": model.getHistory()["loss"],
            "datasets": len(os.listdir(datasets)) if os.path.isdir(datasets) else 0,
            "predicted": model.transform(df).count(),
            "no_slot": _feed_without_a_slot(spark, df, store)}


def _feed_without_a_slot(spark, df, store: str) -> Dict[str, Any]:
    """A streamed 1-rank fit fed beside its rank from the spare slot, which another job (as
    another client's would) takes as soon as the fit has claimed it: the fit fails once, in
    about spark.sparktrain.feedWaitSeconds, saying why, though the client cannot see tasks."""

    from sparktrain.session import slots
    from support.helpers import linear_estimator

    tag = "connect-slot-holder"

    def hold(batches):
        import time as clock

        import pandas as pd

        for _ in batches:
            pass
        clock.sleep(120)
        yield pd.DataFrame({"x": [1]})

    def take_the_spare_slot():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                c.spare for claims in slots._CLAIMS.values() for c in claims.values()):
            time.sleep(0.005)
        spark.addTag(tag)  # this thread's operations
        try:
            spark.range(0, 1, 1, 1).mapInPandas(hold, "x long").collect()
        except Exception:  # noqa: BLE001 - interrupted at the end
            pass

    holder = threading.Thread(target=take_the_spare_slot, daemon=True)
    holder.start()
    spark.conf.set("spark.sparktrain.feedWaitSeconds", "10")
    started = time.time()
    try:
        linear_estimator(store, num_proc=1, epochs=1, batch_size=50, input_mode="stream",
                         max_attempts=3).fit(df.select("features", "label"))
        message = None
    except Exception as exc:  # noqa: BLE001 - the message is the finding
        message = str(exc)
    finally:
        spark.conf.unset("spark.sparktrain.feedWaitSeconds")
        spark.interruptTag(tag)
        holder.join(30)
    return {"message": message, "seconds": time.time() - started}


def huggingface(spark, workdir: str) -> Dict[str, Any]:
    """A tiny BERT as it is (loss=None, keyword forward) on a text column over Connect: the
    columns the tokenizer makes are learned on the client, and transform reads the text."""
    import torch

    from sparktrain import TorchEstimator
    from support import hf_models

    tok = hf_models.tokenizer()
    model = hf_models.tiny_bert(tok.vocab_size)
    df = spark.createDataFrame(hf_models.sentences(400, seed=1), "text string, label long")
    fitted = TorchEstimator(
        num_proc=2, store=os.path.join(workdir, "store"), model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), loss=None,
        transformation_fn=hf_models.Tokenize(tok), feature_cols=["input_ids", "attention_mask"],
        label_cols=["label"], batch_size=32, epochs=2, verbose=0).fit(df)
    predicted = fitted.transform(df.select("text").limit(50)).toPandas()["label__output"]
    return {"history": fitted.getHistory()["loss"], "predicted": len(predicted),
            "width": len(predicted[0]), **_generation(spark, workdir)}


def _generation(spark, workdir: str) -> Dict[str, Any]:
    """A causal LM trained here (to count) answers rows over Connect; saved and loaded."""
    from sparktrain import TextGenerator
    from support import hf_models

    rows = hf_models.count_rows(20, seed=4)
    prompts = spark.createDataFrame(rows, "prompt string, expected string")
    generator = TextGenerator(model=hf_models.train_counting(150),
                              tokenizer=hf_models.count_tokenizer(), promptCol="prompt",
                              maxNewTokens=10)
    first = generator.transform(prompts).select("expected", "generated.text").collect()
    path = os.path.join(workdir, "generator")
    generator.write().overwrite().save(path)
    again = TextGenerator.load(path).transform(prompts).select("generated.text").collect()
    # answers shaped by DDL text (parsed by the server), typed by from_json over Connect
    tok = hf_models.byte_tokenizer()
    shaped = TextGenerator(model=hf_models.untrained_llama(len(tok)), tokenizer=tok,
                           promptCol="prompt", maxNewTokens=40,
                           responseSchema="ok boolean not null, n tinyint not null")
    typed = shaped.transform(prompts.limit(6)).select("generated.parsed.*")
    return {"generated_exact": sum(r["text"] == r["expected"] for r in first),
            "generated_reloaded": [r["text"] for r in again] == [r["text"] for r in first],
            "schema_types": typed.dtypes, "schema_parsed": sum(
                r["ok"] is not None and r["n"] is not None for r in typed.collect())}


def mlflow_tracking(spark, workdir: str) -> Dict[str, Any]:
    """A fit logged by sparktrain.mlflow.autolog() over Connect (the tracking server's URI in
    MLFLOW_TRACKING_URI), its run as the server has it, and its pyfunc against transform."""
    import mlflow
    import numpy as np

    import sparktrain.mlflow
    from support.helpers import linear_estimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y, strict=True)],
                               "features array<double>, label double")
    sparktrain.mlflow.autolog()
    model = linear_estimator(os.path.join(workdir, "store"), epochs=2, batch_size=50,
                             run_id="over-connect").fit(df)
    client = mlflow.MlflowClient()
    run = client.search_runs([mlflow.get_experiment_by_name(
        os.environ["MLFLOW_EXPERIMENT_NAME"]).experiment_id],
        "tags.`sparktrain.run_id` = 'over-connect'")[0]
    logged = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"),
                                      key=lambda m: m.step)]
    test = df.limit(20)
    expected = model.transform(test).toPandas()["label__output"].tolist()
    pyfunc = mlflow.pyfunc.load_model(run.data.tags["sparktrain.model_uri.pyfunc"])
    got = pyfunc.predict(test.select("features").toPandas())["label__output"].tolist()
    return {"history": model.getHistory()["loss"], "logged": logged,
            "session": run.data.tags.get("sparktrain.session"), "status": run.info.status,
            "expected": expected, "pyfunc": got}


def big_model(spark, workdir: str) -> Dict[str, Any]:
    """A 166 MiB model (a frozen table beside a trained head) over Connect, whose messages are
    capped at 128 MiB: fit, transform, save, load, transform; the same as a Pipeline stage;
    then a 134 MiB Keras model."""
    import numpy as np
    import torch
    from pyspark.ml import Pipeline, PipelineModel

    from sparktrain import TorchEstimator, TorchModel
    from support.big_models import FrozenTable

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5
    df = spark.createDataFrame([(a.tolist(), float(b)) for a, b in zip(x, y, strict=True)],
                               "features array<double>, label double")
    net = FrozenTable(rows=680_000)
    size = sum(t.numel() * t.element_size() for t in net.state_dict().values())
    est = TorchEstimator(num_proc=2, model=net, store=os.path.join(workdir, "store"),
                         optimizer=torch.optim.Adam(net.head.parameters(), lr=0.1),
                         loss=torch.nn.MSELoss(), feature_cols=["features"],
                         label_cols=["label"], batch_size=20, epochs=3, verbose=0)

    def predictions(model) -> list:
        return model.transform(df.limit(40)).toPandas()["label__output"].tolist()

    fitted = est.fit(df)
    first = predictions(fitted)
    path = os.path.join(workdir, "saved")
    fitted.write().overwrite().save(path)
    reloaded = predictions(TorchModel.load(path))
    pipeline = Pipeline(stages=[est]).fit(df)
    pipeline_path = os.path.join(workdir, "pipeline")
    pipeline.write().overwrite().save(pipeline_path)
    piped = predictions(PipelineModel.load(pipeline_path))
    mse = float(np.mean((np.array(first) - y[:40]) ** 2))
    return {"model_mib": size / 2**20, "history": fitted.getHistory()["loss"], "mse": mse,
            "label_var": float(np.var(y)), "first": first, "reloaded": reloaded,
            "pipeline": piped, **_big_keras_model(spark, workdir, x, y)}


def _big_keras_model(spark, workdir: str, x, y) -> Dict[str, Any]:
    """The same for Keras: a 134 MiB frozen Embedding beside a trained Dense head."""
    import keras
    import numpy as np

    from sparktrain import KerasEstimator, KerasModel

    rows = 550_000
    ids = (np.abs(x[:, 0]) * 1000).astype(np.int64) % rows
    df = spark.createDataFrame([(a.tolist(), int(i), float(b))
                                for a, i, b in zip(x, ids, y, strict=True)],
                               "features array<double>, ids long, label double")
    features = keras.Input((4,), name="features")
    token = keras.Input((1,), name="ids", dtype="int32")
    table = keras.layers.Embedding(rows, 64, trainable=False)(token)
    joined = keras.layers.Concatenate()([features, keras.layers.Flatten()(table)])
    model = keras.Model([features, token], keras.layers.Dense(1)(joined))
    fitted = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.Adam(0.1),
                            loss="mse", feature_cols=["features", "ids"], label_cols=["label"],
                            batch_size=20, epochs=2, store=os.path.join(workdir, "kstore"),
                            verbose=0).fit(df)
    first = fitted.transform(df.limit(40)).toPandas()["label__output"].tolist()
    path = os.path.join(workdir, "ksaved")
    fitted.write().overwrite().save(path)
    again = KerasModel.load(path).transform(df.limit(40)).toPandas()["label__output"].tolist()
    return {"keras_mib": rows * 64 * 4 / 2**20, "keras_history": fitted.getHistory()["loss"],
            "keras_first": first, "keras_reloaded": again}


SCENARIOS: Dict[str, Callable] = {"readme": readme, "faults": faults, "horovod": horovod,
                                  "stream": stream,
                                  "huggingface": huggingface, "big_model": big_model,
                                  "mlflow": mlflow_tracking}
#: the line on stderr that ends a scenario's part of it, before its findings go to stdout
END_MARK = "=== sparktrain connect scenario ended: {} ==="


def run_scenario(spark, name: str, workdir: str) -> Dict[str, Any]:
    """One scenario's findings (its ``"error"``: the traceback, where it raised), and what the
    client had meanwhile (``"client_side"``, :class:`_ClientSide`)."""
    import traceback

    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)  # per scenario
    sys.stderr.write(f"=== sparktrain connect scenario: {name} ===\n")
    os.makedirs(workdir, exist_ok=True)
    watch = _ClientSide().start()
    started = time.time()
    try:
        found = SCENARIOS[name](spark, workdir)
    except Exception:  # noqa: BLE001 - the scenario's test fails with it; the next ones run
        found = {"error": traceback.format_exc()}
    found["seconds"] = time.time() - started
    found["client_side"] = watch.report()
    return found


def main(scenarios: str, url: str, workdir: str) -> None:
    """``scenarios``: one name (its findings are the last line of stdout), or several,
    comma-separated, run in that order in this one process and session, each in a folder of
    its own under ``workdir``: after each, ``END_MARK`` on stderr, then
    ``{"scenario": name, "found": ...}`` on stdout."""
    from pyspark.sql import SparkSession

    names = scenarios.split(",")
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    spark = SparkSession.builder.remote(url).getOrCreate()
    for name in names:
        if len(names) == 1:
            found = run_scenario(spark, name, workdir)
            if "error" in found:
                raise RuntimeError(found["error"])
            print(json.dumps(found), flush=True)
            break
        found = run_scenario(spark, name, os.path.join(workdir, name))
        sys.stderr.write(END_MARK.format(name) + "\n")
        sys.stderr.flush()
        print(json.dumps({"scenario": name, "found": found}), flush=True)
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)  # and for the shutdown
    # Release the scenarios' remote ML objects (pipeline stages held by reference cycles) while
    # the session is up: pyspark's finalizer deletes each from the server's ML cache with a
    # blocking gRPC call, which, left to interpreter shutdown, waited forever for a reply the
    # server had sent (seen twice in full suite runs, as a hang in `_delete_ml_cache`).
    gc.collect()
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:4])
