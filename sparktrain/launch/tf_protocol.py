"""What a Spark task and its TensorFlow child process exchange: the spec and the workdir files.

A leaf module (no sparktrain imports, no TensorFlow): the estimator builds a
:class:`KerasTrainSpec`, the launchers (:mod:`.tf_multiworker`, :mod:`.tf_parameter_server`,
:mod:`.tfos`) write it with the pickled payload into a directory, and the child
(``python -m sparktrain.estimators.keras_worker DIR``) answers through the files named here.

Example::

    write_inputs(workdir, replace(spec, rank=1, world_size=2), payload_bytes)
    spec = read_spec(workdir)          # in the child
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

WORKER_MODULE = "sparktrain.estimators.keras_worker"  # the child: python -m WORKER_MODULE DIR
SPEC_FILE = "spec.json"
PAYLOAD_FILE = "payload.pkl"
RESULT_FILE = "result.pkl"  # the training process's result (pickled)
ERROR_FILE = "error.txt"  # its traceback, when it failed
USER_ERROR_FILE = "user_error.txt"  # where the user's code raised the error, if it did
READY = "ready"  # written by a serving process once its server is up
SHARD_INFO = "shard.json"  # written by a serving process that prepared data for the trainer
PROGRESS_PREFIX = "\x1esparktrain-progress "  # a stdout line carrying a progress event


@dataclass
class KerasTrainSpec:
    """Plain-valued description of one Keras fit, shipped to every rank (as JSON); the pickled
    objects (model, optimizer, loss, metrics, callbacks, transformation_fn, the strategy
    class) travel separately as the payload."""

    dataset_root: str
    layouts: Dict[str, Any]
    columns: List[Dict[str, Any]]
    feature_cols: List[str]
    label_cols: List[str]
    sample_weight_col: Optional[str]
    batch_size: int
    val_batch_size: int
    epochs: int
    shuffle: bool
    seed: Optional[int]
    verbose: int
    backend: str
    strategy: str  # the registered name (messages); the class travels in the payload
    storage_options: Dict[str, Any] = field(default_factory=dict, repr=False)
    input_shapes: Optional[List[List[int]]] = None
    label_shapes: Optional[List[List[int]]] = None
    loss_weights: Optional[List[float]] = None
    backend_env: Optional[Dict[str, str]] = field(default=None, repr=False)
    best_model: Optional[Dict[str, Any]] = None  # checkpoint_callback's settings, see keras_checkpoint
    strategy_options: Dict[str, Any] = field(default_factory=dict)  # KerasStrategy.check's
    # the training loop's settings (EstimatorBase._loop_options)
    train_steps: Optional[int] = None
    val_steps: Optional[int] = None
    inmemory_cache_all: bool = False
    backward_passes_per_step: int = 1
    scale_learning_rate: bool = False
    mixed_precision: Optional[str] = None
    deadline: Optional[float] = None  # time.time() after which training stops at an epoch end
    fit_id: str = ""  # the fit's attempts share it (see sparktrain.epochs)
    run_path: Optional[str] = None
    # how the ranks read and decode (compat.reader_options)
    train_prefetch: int = 2
    val_prefetch: int = 2
    reader_pool: str = "thread"
    train_decode_workers: int = 2
    val_decode_workers: int = 2
    mp_start_method: Optional[str] = None
    # set by the launcher for each process
    rank: int = 0
    world_size: int = 1
    attempt: int = 0
    role: str = ""  # "": the training loop; else a serving role of the strategy's cluster
    launch_info: Dict[str, Any] = field(default_factory=dict)  # what the launch gathered

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "KerasTrainSpec":
        return cls(**json.loads(text))


def write_inputs(workdir: str, spec: KerasTrainSpec, payload: bytes) -> None:
    """The child's inputs: ``spec.json`` and ``payload.pkl`` in ``workdir``."""
    with open(os.path.join(workdir, SPEC_FILE), "w") as f:
        f.write(spec.to_json())
    with open(os.path.join(workdir, PAYLOAD_FILE), "wb") as f:
        f.write(payload)


def read_spec(workdir: str) -> KerasTrainSpec:
    with open(os.path.join(workdir, SPEC_FILE)) as f:
        return KerasTrainSpec.from_json(f.read())


def progress(**event: Any) -> None:
    """Report a progress event to the task (one stdout line it relays to the driver)."""
    print(PROGRESS_PREFIX + json.dumps(event), flush=True)
