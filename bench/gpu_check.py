"""GPU check: sparktrain's torch GPU paths on one NVIDIA GPU, without Spark or Java.

Drives what a barrier task or a prediction task runs, by hand, as ``tests/test_rank_loops.py``
does (its helpers are imported from there): Parquet files in the layout materialization writes,
the ``TorchTrainSpec`` and cloudpickled payload the estimator builds, and
``torch_loop.train`` as rank 0 of 1, with a ``RankContext`` that holds GPU ``"0"`` (as Spark's
``TaskContext.resources()`` would) and a barrier that answers ``allGather`` itself. No
SparkSession or JVM is ever started (the last check says so).

Checks (one ``CHECK <name> PASS|FAIL|SKIP <figures>`` line each):

* ``ddp_fp32``, ``ddp_bf16``, ``ddp_fp16``: the rank loop on ``test_rank_loops``' regression data
  and ``Linear(4, 1)`` (fp16 with a GradScaler); losses fall, the weights file loads, and a
  callback sees from inside the loop the process group's backend (nccl), the device and the
  dtype the model computes in.
* ``fsdp_bf16``: ``strategy="fsdp"`` (FSDP2, blocks = the Linears, bf16 policy) on an MLP.
* ``hf_bert_bf16``: the tiny BERT of ``tests/support/hf_models.py`` fine-tuned on raw text through
  the rank loop (tokenizer as ``transformation_fn``, the model's own loss), held-out accuracy.
* ``gpu_inference``: ``TorchModel``'s per-Arrow-batch prediction function (the Arrow UDF's
  body; the pandas UDF's before pyspark 4.1) in a task holding GPU 0, against the module on the
  CPU; rows/s GPU vs CPU.
* ``ddp_throughput``: steady steps/s of the rank loop vs a hand-written loop on the same device.
* ``gpu_feed``: rows/s one rank feeds its device from the rank-local cache in epochs after the
  first, against the same rows sliced from one host tensor (the ceiling).
* ``local_ranks``: a task holding every GPU of the machine runs one rank process per GPU
  (``launch.local_ranks``, ``CUDA_VISIBLE_DEVICES`` its own), one NCCL group; the rank loop
  trains in it. On the CPU: two ranks on fake GPUs, gloo.
* ``local_ranks_uuid``: the same where the executor's ``CUDA_VISIBLE_DEVICES`` lists its GPUs
  by UUID (as YARN's or Kubernetes' GPU plugins may) and Spark's addresses are positions in
  it: each rank is shown its own ``GPU-<uuid>`` and computes on ``cuda:0``.
* ``no_jvm``: no SparkContext/gateway/session exists at the end.

Run on the GPU machine from the repository root (pure-Python pyspark and py4j on the path)::

    PYTHONPATH=.gpu/site:. python3 bench/gpu_check.py

and here, the same logic on the CPU with gloo and small sizes (about 20 s on 2 cores)::

    .venv/bin/python bench/gpu_check.py --cpu

``--only a,b`` runs some checks. Results go to ``$OUT/gpu_check.json`` when ``OUT`` is set; the
exit status is 0 whatever the results (the summary line says how many failed).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(REPO, "tests"), REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)
NOTES: List[str] = []  # what the environment needed worked around, printed and in the JSON


def _missing(module: str) -> bool:
    try:
        importlib.import_module(module)
        return False
    except ImportError:
        return True


def _prepare_environment() -> None:
    """What the GPU machine lacks for importing the test helpers and forming a process group."""
    if _missing("pytest"):
        # tests/test_rank_loops.py imports pytest for its fixtures and marks: a stand-in
        def mark(*args: Any, **kwargs: Any) -> Any:
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else (lambda f: f)

        stub = types.ModuleType("pytest")
        stub.fixture = mark
        stub.mark = type("Marks", (), {"__getattr__": lambda self, name: mark})()
        sys.modules["pytest"] = stub
        NOTES.append("pytest missing: a stand-in module lets tests/test_rank_loops.py import")
    names = ("TORCH_GLOO_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
    if _missing("psutil") and not any(os.environ.get(n) for n in names):
        # launch/torch_ddp.py imports psutil to find the Gloo interface unless one is set
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        NOTES.append("psutil missing (sparktrain[torch] requires it): GLOO_SOCKET_IFNAME=lo set "
                     "so launch/torch_ddp.py does not import it")


_prepare_environment()
import test_rank_loops as rank_loops  # noqa: E402  (after the pytest stand-in)
import torch  # noqa: E402 - after sys.path is set


@dataclass(frozen=True)
class Sizes:
    mlp_rows: int  # fsdp_bf16's training rows (64 features -> 10 classes)
    hidden: int  # MLP width of fsdp_bf16 and ddp_throughput
    infer_rows: int  # gpu_inference's rows (256 -> 1024 -> 1024 -> 10)
    tput_rows: int  # ddp_throughput's rows per epoch (batch 256, 3 epochs)
    feed_rows: int  # gpu_feed's rows (64 float32 features + a long label)


GPU_SIZES = Sizes(mlp_rows=8192, hidden=1024, infer_rows=100_000, tput_rows=65_536,
                  feed_rows=2_000_000)
CPU_SIZES = Sizes(mlp_rows=4096, hidden=128, infer_rows=20_000, tput_rows=16_384,
                  feed_rows=200_000)
FEATURES, CLASSES, ARROW_BATCH, FEED_BATCH = 64, 10, 10_000, 1024
INFERENCE_BATCH_SIZES = (4096, 10_000)  # gpu_inference on a GPU, besides the param's default


@dataclass
class Env:
    gpu: bool
    device: torch.device
    cpus: int  # the task's CPUs (torch threads in the loop and the predictor)
    root: str  # scratch directory, removed at the end
    sizes: Sizes


@dataclass
class Result:
    name: str
    status: str = "PASS"
    figures: Dict[str, Any] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0


class Skip(Exception):
    """A check that cannot run here."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# -- what runs inside the rank loop ----------------------------------------------------------

class Probe:
    """A training callback that writes, as JSON to ``path`` at ``on_train_end``, what the loop
    ran with: the process group's backend and a one-rank ``all_reduce`` through it, where the
    parameters live, the dtype the first ``Linear`` computes in (autocast or FSDP's policy),
    each epoch's end (``time.perf_counter``) and the peak CUDA memory. The loop trains with an
    unpickled copy of it, hence the file."""

    def __init__(self, path: str) -> None:
        self.path, self.seen, self.ends = path, {}, []

    def _dtype(self, module: Any, inputs: Any, output: Any) -> None:
        self.seen["compute_dtype"] = str(output.dtype).replace("torch.", "")
        self._hook.remove()  # once: no hook in the timed steps

    def on_train_begin(self, model: Any, history: Any) -> None:
        import torch.distributed as dist

        param = next(model.parameters())
        local = param.to_local() if hasattr(param, "to_local") else param  # FSDP2's DTensor
        if local.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        probe = torch.ones(1, device=local.device)
        dist.all_reduce(probe)
        self.seen.update(backend=str(dist.get_backend()), world_size=dist.get_world_size(),
                         device=str(local.device), sharded=hasattr(param, "to_local"),
                         all_reduce=float(probe.item()))
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        self._hook = first.register_forward_hook(self._dtype)

    def on_epoch_end(self, epoch: int, logs: Dict[str, float]) -> bool:
        self.ends.append(time.perf_counter())
        return False

    def on_train_end(self, model: Any) -> None:
        if self.seen.get("device", "").startswith("cuda"):
            self.seen["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        with open(self.path, "w") as f:
            json.dump(dict(self.seen, epoch_ends=self.ends), f)


def accuracy(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Metric: share of rows whose argmax is the label."""
    return (output.argmax(dim=1) == label).float().mean()


def train_rank(env: Env, spec: Any, payload: bytes) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``torch_loop.train`` as rank 0 of 1 on ``env``'s device; ``(its result, what the Probe
    saw)``. The task's GPU comes as Spark hands it (``resources``), the rendezvous through the
    one-rank barrier (``TorchDDP`` opens its own ``TCPStore``: no MASTER_ADDR/PORT)."""
    from sparktrain.launch.rank_context import RankContext
    from sparktrain.loop.torch_loop import train

    job = rank_loops._OneRank()
    ctx = RankContext(rank=0, world_size=1, hosts=["127.0.0.1"], cpus=env.cpus,
                      resources={"gpu": ["0"]} if env.gpu else {}, barrier=job, client=job)
    threads = torch.get_num_threads()
    try:
        result = train(spec, payload, ctx)
    except Exception as exc:
        raise RuntimeError(f"{exc}\n--- rank log ---\n" + "\n".join(job.lines[-20:])) from exc
    finally:
        torch.set_num_threads(threads)
    with open(probe_path(spec)) as f:
        return result, json.load(f)


def probe_path(spec: Any) -> str:
    return os.path.join(spec.run_path, "probe.json")


def spec_for(env: Env, data: Dict[str, Any], name: str, **changes: Any) -> Any:
    """``test_rank_loops.torch_spec`` on ``env``'s device, its run in the scratch directory."""
    run = os.path.join(env.root, "runs", name)
    os.makedirs(run)
    return rank_loops.torch_spec(data, use_gpu=env.gpu, run_path=run, **changes)


def payload(net: torch.nn.Module, optimizer: Any, loss: Any, callbacks: List[Any],
            metrics: List[Callable] = (), transform: Any = None, strategy: str = "ddp",
            options: Optional[Dict[str, Any]] = None) -> bytes:
    """What ``TorchEstimator._payload`` ships (``test_rank_loops.torch_payload`` for any model)."""
    from sparktrain.loop.torch_files import ShippedModule, save_weights
    from sparktrain.options.payload import TorchPayload
    from sparktrain.strategies import TORCH_STRATEGIES, load_strategy

    options = dict(options or {})
    weights = save_weights(net.state_dict(), os.path.join(tempfile.mkdtemp(), "weights.pt"))
    return TorchPayload(model=ShippedModule.of(net, optimizer, weights), loss=loss,
                        metrics=list(metrics), callbacks=list(callbacks),
                        transformation_fn=transform, fsdp_wrap=options.get("fsdp_wrap"),
                        strategy=load_strategy(TORCH_STRATEGIES, strategy),
                        strategy_options=options).dumps()


def write_split(root: str, split: str, table: Any, group_rows: int) -> List[Any]:
    """``table`` as one Parquet file of ``split``; its ``layouts`` entry."""
    import pyarrow.parquet as pq

    name = f"split={split}/part-00000.parquet"
    os.makedirs(os.path.join(root, f"split={split}"))
    pq.write_table(table, os.path.join(root, name), row_group_size=group_rows)
    rows = table.num_rows
    return [name, [min(group_rows, rows - start) for start in range(0, rows, group_rows)]]


def dataset(root: str, splits: Dict[str, Any], columns: List[Any], group_rows: int
            ) -> Dict[str, Any]:
    os.makedirs(root)
    return {"root": root, "columns": [c.to_json() for c in columns],
            "layouts": {s: [write_split(root, s, t, group_rows)] for s, t in splits.items()}}


def classes_table(rows: int, seed: int, features: int = FEATURES) -> Any:
    """``features`` (array<float>) and ``label`` (long): the argmax class of a fixed linear map."""
    import pyarrow as pa

    teacher = np.random.default_rng(99).normal(size=(features, CLASSES)).astype(np.float32)
    x = np.random.default_rng(seed).normal(size=(rows, features)).astype(np.float32)
    return pa.table({"features": list_array(x),
                     "label": pa.array((x @ teacher).argmax(axis=1).astype(np.int64))})


def list_array(x: np.ndarray) -> Any:
    """The rows of the 2-d ``x`` as an Arrow ``list<float>`` array, without a Python object per
    row (what Spark sends for an ``array<float>`` column)."""
    import pyarrow as pa

    offsets = pa.array(np.arange(0, x.size + 1, x.shape[1], dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1)))


def classes_data(env: Env, name: str, rows: int, val_rows: int) -> Dict[str, Any]:
    from sparktrain.data.columns import SCALAR, VECTOR, ColumnSpec

    splits = {"train": classes_table(rows, 0)}
    if val_rows:
        splits["val"] = classes_table(val_rows, 1)
    return dataset(os.path.join(env.root, name), splits,
                   [ColumnSpec("features", VECTOR, "float32", FEATURES),
                    ColumnSpec("label", SCALAR, "int64", 1)], group_rows=8192)


def mlp(inputs: int, hidden: int, outputs: int = CLASSES, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, outputs))


def loaded(net: torch.nn.Module, result: Dict[str, Any]) -> torch.nn.Module:
    """``net`` with the weights file rank 0 wrote (what ``TorchModel`` maps)."""
    path = result["weights_file"].local_path()
    net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return net.eval()


def observed(env: Env, seen: Dict[str, Any], dtype: Optional[str]) -> Dict[str, Any]:
    """The Probe's figures, checked: backend, device, the all_reduce, the compute dtype."""
    backend, device = ("nccl", "cuda:0") if env.gpu else ("gloo", "cpu")
    expect(seen["backend"] == backend, f"backend {seen['backend']}, expected {backend}")
    expect(seen["device"] == device, f"parameters on {seen['device']}, expected {device}")
    expect(seen["all_reduce"] == 1.0, f"one-rank all_reduce gave {seen['all_reduce']}")
    if dtype is not None:
        expect(seen.get("compute_dtype") == dtype,
               f"first Linear computed in {seen.get('compute_dtype')}, expected {dtype}")
    return {k: seen[k] for k in ("backend", "device", "compute_dtype", "peak_mib") if k in seen}


# -- the checks -------------------------------------------------------------------------------

def regression_data(env: Env, name: str) -> Dict[str, Any]:
    """``test_rank_loops``' dataset fixture: 256 + 64 rows of ``x @ WEIGHTS + 0.5``."""
    from sparktrain.data.columns import SCALAR, VECTOR, ColumnSpec

    root = os.path.join(env.root, name)
    os.makedirs(root)
    return {"root": root,
            "layouts": {"train": [rank_loops._write_split(root, "train", rank_loops.ROWS, 0, 100)],
                        "val": [rank_loops._write_split(root, "val", rank_loops.VAL_ROWS, 1, 64)]},
            "columns": [ColumnSpec("features", VECTOR, "float32", 4).to_json(),
                        ColumnSpec("label", SCALAR, "float32", 1).to_json()]}


def check_ddp(env: Env, precision: Optional[str]) -> Dict[str, Any]:
    """``test_torch_loop_trains_validates_and_reports`` on the device, with ``precision``."""
    name = f"ddp_{precision or 'fp32'}"
    spec = spec_for(env, regression_data(env, f"{name}-data"), name,
                    mixed_precision=precision)
    start = time.perf_counter()
    result, seen = train_rank(env, spec, rank_loops.torch_payload([Probe(probe_path(spec))]))
    seconds = time.perf_counter() - start
    losses, val = result["history"]["loss"], result["history"]["val_loss"]
    expect(all(np.isfinite(losses + val)), f"non-finite losses {losses} {val}")
    if precision is None:
        falling = all(b < a for a, b in zip(losses, losses[1:], strict=False))
        expect(falling, f"losses not falling: {losses}")
    else:
        expect(losses[-1] < 0.5 * losses[0], f"loss did not halve: {losses}")
    expect(val[-1] < 0.5 * val[0], f"val_loss did not halve: {val}")
    target = torch.from_numpy(rank_loops.WEIGHTS)
    distance = lambda m: float((m.weight.detach().ravel() - target).abs().sum())  # noqa: E731
    before = distance(rank_loops.initial_net())
    after = distance(loaded(rank_loops.initial_net(), result))
    expect(after < 0.5 * before, f"weights did not move toward the data's ({before} -> {after})")
    dtype = {None: "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
    return {"loss": f"{losses[0]:.3g}->{losses[-1]:.3g}",
            "val_loss": f"{val[0]:.3g}->{val[-1]:.3g}",
            "weight_distance": f"{before:.2f}->{after:.2f}", "train_s": round(seconds, 2),
            **observed(env, seen, dtype)}


def check_fsdp(env: Env) -> Dict[str, Any]:
    """``strategy="fsdp"``, each Linear its own FSDP2 unit, bf16 mixed precision."""
    rows = env.sizes.mlp_rows
    data = classes_data(env, "fsdp-data", rows, rows // 4)
    spec = spec_for(env, data, "fsdp", strategy="fsdp", mixed_precision="bf16", epochs=4,
                    batch_size=64, val_batch_size=256)
    net = mlp(FEATURES, env.sizes.hidden)
    blob = payload(net, torch.optim.Adam(net.parameters(), lr=1e-3), torch.nn.CrossEntropyLoss(),
                   [Probe(probe_path(spec))], [accuracy], strategy="fsdp",
                   options={"fsdp_wrap": [torch.nn.Linear]})
    result, seen = train_rank(env, spec, blob)
    history = result["history"]
    losses = history["loss"]
    expect(all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], f"losses {losses}")
    expect(seen["sharded"], "parameters are not FSDP2 DTensors")
    model = loaded(mlp(FEATURES, env.sizes.hidden, seed=1), result)
    val = classes_table(rows // 4, 1).to_pydict()
    x = torch.tensor(np.array(val["features"], dtype=np.float32))
    with torch.no_grad():
        acc = float((model(x).argmax(1).numpy() == np.array(val["label"])).mean())
    expect(acc >= 0.6 and abs(acc - history["val_accuracy"][-1]) < 0.05,
           f"loaded weights' accuracy {acc:.3f}, the loop's val_accuracy "
           f"{history['val_accuracy'][-1]:.3f}")
    return {"loss": f"{losses[0]:.3g}->{losses[-1]:.3g}", "val_accuracy": round(acc, 4),
            **observed(env, seen, "bfloat16")}


def _treat_as_installed(packages: List[str]) -> None:
    """``sparktrain.pickling`` pickles by value (as the user's own code) every module outside
    sysconfig's stdlib/site-packages directories, which fails for transformers ("cannot pickle
    '_Classes' object") when it is installed elsewhere (``PYTHONPATH``, ``--target``, a user
    site): such directories are counted as installed for this run, with a note."""
    from sparktrain import pickling

    for name in packages:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if pickling._is_user_module(module):
            where = os.path.dirname(os.path.dirname(os.path.realpath(module.__file__)))
            pickling._INSTALLED += (where,)
            NOTES.append(f"{name} is in {where}, outside sysconfig's site-packages: "
                         f"sparktrain.pickling would pickle it by value; counted as installed")
            print(f"note: {NOTES[-1]}", flush=True)


def check_hf(env: Env) -> Dict[str, Any]:
    """The tiny BERT on raw text: ``Tokenize`` as transformation_fn, the model's own loss."""
    import pyarrow as pa

    from sparktrain.data.columns import SCALAR, STRING, ColumnSpec
    from support import hf_models

    def table(rows: int, seed: int) -> Any:
        texts, labels = zip(*hf_models.sentences(rows, seed=seed), strict=True)
        return pa.table({"text": pa.array(texts), "label": pa.array(labels, type=pa.int64())})

    _treat_as_installed(["transformers", "tokenizers", "huggingface_hub", "safetensors"])
    tok = hf_models.tokenizer()
    data = dataset(os.path.join(env.root, "text"),
                   {"train": table(1200, 1), "val": table(300, 2)},
                   [ColumnSpec("text", STRING, "str", 1), ColumnSpec("label", SCALAR, "int64", 1)],
                   group_rows=400)
    spec = spec_for(env, data, "bert", feature_cols=["input_ids", "attention_mask"],
                    mixed_precision="bf16", epochs=2, seed=3)
    bert = hf_models.tiny_bert(tok.vocab_size)
    blob = payload(bert, torch.optim.AdamW(bert.parameters(), lr=3e-3), None,
                   [Probe(probe_path(spec))], [accuracy], transform=hf_models.Tokenize(tok))
    result, seen = train_rank(env, spec, blob)
    history = result["history"]
    expect(history["loss"][-1] < history["loss"][0], f"losses {history['loss']}")
    # the weights file on the device, predicting the held-out texts in bf16
    model = loaded(hf_models.tiny_bert(tok.vocab_size, seed=1), result).to(env.device)
    texts, labels = zip(*hf_models.sentences(300, seed=2), strict=True)
    batch = hf_models.Tokenize(tok)({"text": np.array(texts, dtype=object)})
    with torch.no_grad(), torch.autocast(env.device.type, dtype=torch.bfloat16):
        logits = model(**{k: torch.from_numpy(v).to(env.device) for k, v in batch.items()}).logits
    acc = float((logits.argmax(1).cpu().numpy() == np.array(labels)).mean())
    expect(acc >= 0.9, f"held-out accuracy {acc:.3f} < 0.9 (val_accuracy "
                       f"{history['val_accuracy']})")
    return {"loss": f"{history['loss'][0]:.3g}->{history['loss'][-1]:.3g}",
            "val_accuracy": round(history["val_accuracy"][-1], 4), "accuracy": round(acc, 4),
            **observed(env, seen, "bfloat16")}


@contextlib.contextmanager
def spark_task(cpus: int, gpus: List[str]) -> Iterator[None]:
    """A pyspark ``TaskContext`` holding ``gpus`` and ``cpus``, as a Python worker sets one up
    for a task (``pyspark/worker.py``): what the prediction code asks for its GPU."""
    from pyspark import TaskContext
    from pyspark.resource import ResourceInformation

    context = TaskContext._getOrCreate()
    context._cpus = cpus
    context._resources = {"gpu": ResourceInformation("gpu", gpus)} if gpus else {}
    try:
        yield
    finally:
        TaskContext._setTaskContext(None)


def check_inference(env: Env) -> Dict[str, Any]:
    """The body of ``TorchModel.transform``'s UDF on Arrow batches, in a task holding GPU
    0, against the module called on the CPU; rows/s on the GPU vs the CPU."""

    from sparktrain import TorchModel
    from sparktrain.data.columns import VECTOR, ColumnSpec
    from sparktrain.estimators.prediction import prediction_udf as _prediction_udf

    rows, width = env.sizes.infer_rows, 256
    net = mlp(width, 1024).eval()
    model = TorchModel(model=net, feature_columns=["features"], label_columns=["label"])
    def prediction_udf(batch_size: int) -> Any:
        return _prediction_udf("gpu-check", model._predict_fn_factory(),
                               [ColumnSpec("features", VECTOR, "float32", width)],
                               [model._output_type([CLASSES])], batch_size, None, ["features"])

    udf = prediction_udf(model.getBatchSize())
    x = np.random.default_rng(5).normal(size=(rows, width)).astype(np.float32)
    # what Spark hands the UDF for an array<float> column: Arrow arrays (the Arrow UDF of
    # pyspark >= 4.1) or pandas Series of numpy arrays (the pandas UDF before)
    from pyspark.util import PythonEvalType

    arrow = udf.evalType == getattr(PythonEvalType, "SQL_SCALAR_ARROW_ITER_UDF", None)
    batches = [list_array(x[i:i + ARROW_BATCH]) for i in range(0, rows, ARROW_BATCH)]
    if not arrow:
        batches = [b.to_pandas() for b in batches]

    def stacked(outputs: List[Any]) -> np.ndarray:
        if arrow:
            return np.concatenate([np.asarray(a.flatten()).reshape(len(a), -1) for a in outputs])
        return np.stack([v for s in outputs for v in s])
    with torch.inference_mode():
        expected = net(torch.from_numpy(x)).numpy()

    def predict(gpus: List[str]) -> Tuple[np.ndarray, float, float]:
        threads = torch.get_num_threads()
        try:
            with spark_task(env.cpus, gpus):
                start = time.perf_counter()
                list(udf.func(iter(batches[:1])))  # loads the module (and places it) once
                first = time.perf_counter() - start
                start = time.perf_counter()
                outputs = list(udf.func(iter(batches)))
                rate = rows / (time.perf_counter() - start)
                return stacked(outputs), first, rate
        finally:
            torch.set_num_threads(threads)

    figures: Dict[str, Any] = {}
    cpu, _, figures["cpu_rows_s"] = predict([])
    error = float(np.abs(cpu - expected).max())
    expect(error < 1e-4, f"CPU predictions differ from the module's by {error:.2e}")
    if env.gpu:
        gpu, first, figures["gpu_rows_s"] = predict(["0"])
        error = float(np.abs(gpu - expected).max())
        figures.update(gpu_first_batch_s=round(first, 3), max_abs_error=f"{error:.2e}",
                       speedup=round(figures["gpu_rows_s"] / figures["cpu_rows_s"], 2))
        expect(error < 1e-4, f"GPU predictions differ from the CPU module's by {error:.2e}")
        default_udf = udf
        for size in INFERENCE_BATCH_SIZES:  # what a larger batchSize param would give
            udf = prediction_udf(size)
            figures[f"gpu_rows_s_batch_{size}"] = round(predict(["0"])[2])
        udf = default_udf
    for key in ("cpu_rows_s", "gpu_rows_s"):
        if key in figures:
            figures[key] = round(figures[key])
    figures.update(rows=rows, batch_size=model.getBatchSize(), cpus=env.cpus,
                   udf="arrow" if arrow else "pandas")
    return figures


def check_feed(env: Env) -> Dict[str, Any]:
    """What one rank feeds its device in epochs after the first: the rank-local cache
    (``ShardReader(local_cache=True)``, shuffled over the shard, as a fit with ``epochs > 1``
    reads) through the loop's ``Batches`` onto the device, against the ceiling of the same
    rows already in memory (one host tensor sliced and copied to the device), and against
    slicing a tensor already on the device."""
    from sparktrain.data.columns import ColumnSpec
    from sparktrain.data.reader import ShardReader
    from sparktrain.loop.torch_batch import Batches

    rows = env.sizes.feed_rows
    data = classes_data(env, "feed-data", rows, 0)
    spec = spec_for(env, data, "feed", batch_size=FEED_BATCH)
    to_device = Batches(spec, env.device)
    reader = ShardReader(data["root"], data["layouts"]["train"],
                         [ColumnSpec.from_json(c) for c in data["columns"]], 0, 1, FEED_BATCH,
                         shuffle=True, seed=0, local_cache=True,
                         cache_root=os.path.join(env.root, "feed-cache"))

    def sync() -> None:
        if env.gpu:
            torch.cuda.synchronize()

    def rate(one_pass: Callable[[int], int], repeats: int = 3) -> float:
        rates = []
        for epoch in range(1, repeats + 1):
            start = time.perf_counter()
            seen = one_pass(epoch)
            sync()
            expect(seen == rows, f"a pass fed {seen} rows, expected {rows}")
            rates.append(seen / (time.perf_counter() - start))
        return sorted(rates)[len(rates) // 2]

    def cached_pass(epoch: int) -> int:
        fed = 0
        for batch in reader.epoch(epoch):
            features, labels, _ = to_device(batch)
            fed += features[0].shape[0]
        return fed

    threads = torch.get_num_threads()
    torch.set_num_threads(env.cpus)
    try:
        start = time.perf_counter()
        first = cached_pass(0)  # reads the Parquet once, fills the cache
        sync()
        first_s = time.perf_counter() - start
        expect(first == rows and reader.local_cache_complete, "the local cache was not made")
        cached = rate(cached_pass)
        reader.close()
        parts = list(ShardReader(data["root"], data["layouts"]["train"],
                                 [ColumnSpec.from_json(c) for c in data["columns"]], 0, 1,
                                 1 << 16).epoch(0))
        x = torch.from_numpy(np.concatenate([p["features"] for p in parts]))
        y = torch.from_numpy(np.concatenate([p["label"] for p in parts]))
        del parts

        def sliced(xs: torch.Tensor, ys: torch.Tensor) -> Callable[[int], int]:
            def one_pass(epoch: int) -> int:
                fed = 0
                for i in range(0, rows, FEED_BATCH):
                    xb = xs[i:i + FEED_BATCH].to(env.device, non_blocking=True)
                    yb = ys[i:i + FEED_BATCH].to(env.device, non_blocking=True)
                    if xs.device == env.device:  # already there: a copy, as a batch is new
                        xb, yb = xb.clone(), yb.clone()
                    fed += xb.shape[0]
                return fed
            return one_pass

        ceiling = rate(sliced(x, y))
        resident = rate(sliced(x.to(env.device), y.to(env.device))) if env.gpu else None
    finally:
        torch.set_num_threads(threads)
    figures = {"cached_rows_s": round(cached), "ceiling_rows_s": round(ceiling),
               "ratio": round(cached / ceiling, 3), "first_epoch_s": round(first_s, 2),
               "rows": rows, "batch": FEED_BATCH, "device": str(env.device)}
    if resident:
        figures.update(resident_rows_s=round(resident),
                       ratio_to_resident=round(cached / resident, 3))
    return figures


def check_throughput(env: Env) -> Dict[str, Any]:
    """Steady steps/s (epochs 2-3) of the rank loop vs a hand-written loop, same device,
    model, optimizer, batch size and rows (read once into memory for the hand-written one)."""
    import pyarrow.parquet as pq

    rows, batch, epochs = env.sizes.tput_rows, 256, 3
    data = classes_data(env, "throughput-data", rows, 0)
    spec = spec_for(env, data, "throughput", batch_size=batch, epochs=epochs, verbose=0)
    net = mlp(FEATURES, env.sizes.hidden)
    blob = payload(net, torch.optim.Adam(net.parameters(), lr=1e-3), torch.nn.CrossEntropyLoss(),
                   [Probe(probe_path(spec))])
    start = time.perf_counter()
    result, seen = train_rank(env, spec, blob)
    fit_s = time.perf_counter() - start
    steps = rows // batch
    ends = seen["epoch_ends"]
    loop_rate = steps * (epochs - 1) / (ends[-1] - ends[0])

    table = pq.read_table(os.path.join(data["root"], data["layouts"]["train"][0][0]))
    x = np.stack(table["features"].to_numpy(zero_copy_only=False)).astype(np.float32)
    y = table["label"].to_numpy()
    threads = torch.get_num_threads()
    torch.set_num_threads(env.cpus)
    try:
        torch.manual_seed(0)
        plain = mlp(FEATURES, env.sizes.hidden).to(env.device)
        optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
        loss_fn, rng, marks, loss = torch.nn.CrossEntropyLoss(), np.random.default_rng(0), [], None
        for _ in range(epochs):
            order = rng.permutation(rows)
            for step in range(steps):
                index = order[step * batch:(step + 1) * batch]
                xb = torch.from_numpy(x[index]).to(env.device, non_blocking=True)
                yb = torch.from_numpy(y[index]).to(env.device, non_blocking=True)
                loss = loss_fn(plain(xb), yb)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            last = float(loss.detach())  # syncs the device, as the loop's epoch-end all_reduce does
            marks.append(time.perf_counter())
    finally:
        torch.set_num_threads(threads)
    plain_rate = steps * (epochs - 1) / (marks[-1] - marks[0])
    losses = result["history"]["loss"]
    expect(losses[-1] < losses[0], f"losses {losses}")
    return {"ratio": round(loop_rate / plain_rate, 3), "sparktrain_steps_s": round(loop_rate, 1),
            "plain_steps_s": round(plain_rate, 1), "fit_s": round(fit_s, 2),
            "final_loss": f"{losses[-1]:.3g} vs plain {last:.3g}", "steps_per_epoch": steps,
            "device": seen["device"]}


def _local_rank(spec: Any, payload_bytes: bytes, ctx: Any) -> Dict[str, Any]:
    """One local rank's process: the rank loop, and the GPU its process was shown."""
    from sparktrain.loop.torch_loop import train

    result = train(spec, payload_bytes, ctx)
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "local_rank": os.environ.get("LOCAL_RANK"),
            "history": result.get("history") if ctx.rank == 0 else None}


def _gpu_uuids(env: Env, count: int) -> List[str]:
    """The GPUs as a node manager or container runtime lists them in ``CUDA_VISIBLE_DEVICES``
    (``GPU-<uuid>``); made-up ones on the CPU."""
    if not env.gpu:
        return [f"GPU-fake-{i}" for i in range(count)]
    return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(count)]


def check_local_ranks(env: Env, outer: str = "unset") -> Dict[str, Any]:
    """``launch.local_ranks.run_places``: a task holding every GPU of the machine runs one rank
    process per GPU (``CUDA_VISIBLE_DEVICES``: its own), joined into one NCCL group, as a Spark
    task with ``spark.task.resource.gpu.amount=N`` does; on the CPU, two ranks on fake GPUs
    (gloo). ``outer="uuid"``: the executor already sees its GPUs as ``GPU-<uuid>`` entries and
    Spark's addresses are positions in that list; they are translated once, where the ranks
    start (``launch.gpus.physical_gpus``, as ``local_ranks.places`` does), and each rank must
    find its GPU as ``cuda:0``."""
    from sparktrain.launch.gpus import physical_gpus
    from sparktrain.launch.local_ranks import run_places
    from sparktrain.launch.rank_context import Place

    count = torch.cuda.device_count() if env.gpu else 2
    gpus = [str(i) for i in range(count)]  # Spark's addresses
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    expected = gpus
    if outer == "uuid":
        expected = _gpu_uuids(env, count)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(expected)
    run = os.path.join(env.root, "runs", f"local_ranks_{outer}")
    os.makedirs(run)
    spec = rank_loops.torch_spec(regression_data(env, f"local-ranks-{outer}-data"),
                                 use_gpu=True, run_path=run)
    shipped = rank_loops.torch_payload([Probe(probe_path(spec))])
    places = [Place(i, count, ["127.0.0.1"] * count, env.cpus, {"gpu": [gpu]}, 0, i, count)
              for i, gpu in enumerate(physical_gpus(gpus))]
    where = (os.path.join(env.root, f"local-ranks-{outer}-launch"), None, False, 1)
    if not env.gpu:
        os.environ["SPARKTRAIN_FAKE_GPUS"] = ",".join(gpus)  # the ranks train on the CPU
    start = time.perf_counter()
    try:
        results = dict(run_places(functools.partial(_local_rank, spec, shipped), where, places))
    finally:
        os.environ.pop("SPARKTRAIN_FAKE_GPUS", None)
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    seconds = time.perf_counter() - start
    expect(sorted(results) == list(range(count)), f"ranks {sorted(results)}")
    shown = [results[rank]["visible"] for rank in range(count)]
    expect(shown == expected, f"CUDA_VISIBLE_DEVICES per rank {shown}, expected {expected}")
    expect([results[r]["local_rank"] for r in range(count)] == gpus, "LOCAL_RANK per rank")
    losses = results[0]["history"]["loss"]
    expect(losses[-1] < 0.5 * losses[0], f"loss did not halve: {losses}")
    with open(probe_path(spec)) as f:
        seen = json.load(f)
    backend = "nccl" if env.gpu else "gloo"
    expect(seen["backend"] == backend and seen["world_size"] == count,
           f"process group {seen['backend']} of {seen['world_size']}")
    expect(seen["device"] == ("cuda:0" if env.gpu else "cpu"), f"device {seen['device']}")
    return {"ranks": count, "visible": ",".join(shown), "backend": seen["backend"],
            "device": seen["device"], "loss": f"{losses[0]:.3g}->{losses[-1]:.3g}",
            "seconds": round(seconds, 2)}


def check_no_jvm(env: Env) -> Dict[str, Any]:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    state = {"gateway": getattr(SparkContext, "_gateway", None),
             "context": getattr(SparkContext, "_active_spark_context", None),
             "session": getattr(SparkSession, "_instantiatedSession", None),
             "active_session": getattr(SparkSession, "_activeSession", None)}
    expect(all(v is None for v in state.values()), f"Spark started: {state}")
    return {"pyspark_modules": sum(m.startswith("pyspark") for m in sys.modules)}


CHECKS: Dict[str, Callable[[Env], Dict[str, Any]]] = {
    "ddp_fp32": lambda env: check_ddp(env, None),
    "ddp_bf16": lambda env: check_ddp(env, "bf16"),
    "ddp_fp16": lambda env: check_ddp(env, "fp16"),
    "fsdp_bf16": check_fsdp,
    "hf_bert_bf16": check_hf,
    "gpu_inference": check_inference,
    "ddp_throughput": check_throughput,
    "gpu_feed": check_feed,
    "local_ranks": check_local_ranks,
    "local_ranks_uuid": lambda env: check_local_ranks(env, "uuid"),
    "no_jvm": check_no_jvm,
}


def run(name: str, env: Env) -> Result:
    result, start = Result(name), time.perf_counter()
    try:
        if env.gpu and "bf16" in name and not torch.cuda.is_bf16_supported():
            raise Skip("this GPU has no bf16")
        result.figures = CHECKS[name](env)
    except Skip as exc:
        result.status, result.error = "SKIP", str(exc)
    except Exception as exc:  # noqa: BLE001 - every check reports, the next one runs
        result.status, result.error = "FAIL", f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    result.seconds = round(time.perf_counter() - start, 2)
    shown = " ".join(f"{k}={v}" for k, v in result.figures.items()) or result.error
    print(f"CHECK {name} {result.status} {shown} ({result.seconds}s)", flush=True)
    return result


def gpu_meta() -> Dict[str, Any]:
    """GPU 0's name and what changes the numbers: bf16 support, TF32 matmuls, NCCL."""
    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
            "gpu_mib": props.total_memory >> 20, "bf16": torch.cuda.is_bf16_supported()}
    with contextlib.suppress(Exception):  # names that moved between torch versions
        meta["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        version = torch.cuda.nccl.version()
        meta["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
    return meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU with gloo, small sizes")
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument("--cpus", type=int, default=None,
                        help="the task's CPUs (default: 8 on the GPU machine, 1 with --cpu)")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; known: {list(CHECKS)}")

    gpu = not args.cpu
    meta: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "python": sys.version.split()[0], "mode": "cpu" if args.cpu else "gpu"}
    if gpu and not torch.cuda.is_available():
        results = [Result("cuda", "FAIL", error=f"torch {torch.__version__} sees no CUDA GPU; "
                                                  f"run with --cpu for the CPU variant")]
        print(f"CHECK cuda FAIL {results[0].error}")
    else:
        if gpu:
            meta.update(gpu_meta())
        try:
            import transformers
            meta["transformers"] = transformers.__version__
        except ImportError:
            pass
        print("  ".join(f"{k}={v}" for k, v in meta.items()), flush=True)
        for note in NOTES:
            print(f"note: {note}", flush=True)
        root = tempfile.mkdtemp(prefix="sparktrain-gpu-check-")
        previous, tempfile.tempdir = tempfile.tempdir, root  # the helpers' mkdtemp()s too
        env = Env(gpu=gpu, device=torch.device("cuda", 0) if gpu else torch.device("cpu"),
                  cpus=args.cpus or (1 if args.cpu else min(8, os.cpu_count() or 1)),
                  root=root, sizes=CPU_SIZES if args.cpu else GPU_SIZES)
        try:
            results = [run(name, env) for name in names]
        finally:
            tempfile.tempdir = previous
            shutil.rmtree(root, ignore_errors=True)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    total = sum(r.seconds for r in results)
    print(f"SUMMARY {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {total:.1f}s" + (f": failed {[r.name for r in results if r.status == 'FAIL']}"
                                if counts["FAIL"] else ""), flush=True)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump({"meta": meta, "notes": NOTES, "summary": counts,
                       "results": [r.__dict__ for r in results]}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
