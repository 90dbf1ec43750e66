"""The plain values every rank loop trains by, whatever the framework.

:class:`LoopSpec` holds what both loops (:mod:`sparktrain.loop.torch_loop`,
:mod:`sparktrain.loop.keras_loop`) read: the materialized data, the model's columns and
shapes, the epoch settings the shared driver (:class:`sparktrain.loop.epochs.EpochDriver`) takes, and
how the ranks read and decode. Each framework's spec extends it with its own fields
(``TorchTrainSpec``, ``KerasTrainSpec``); the estimator fills the shared ones from its params
(``EstimatorBase._spec_fields``).

A leaf module (standard library only): the launchers, the Keras child process and the
estimators all import it without pulling in a framework or ``pyspark.ml``. Fields are
keyword-only, so a framework's spec can add required fields after defaulted ones.

Example::

    spec = TorchTrainSpec(**estimator._spec_fields(run), strategy="ddp", use_gpu=True)
    spec = KerasTrainSpec.from_json(spec_text)       # in the Keras child process
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Type, TypeVar

S = TypeVar("S", bound="LoopSpec")


@dataclass(kw_only=True)
class LoopSpec:
    """Plain-valued description of one fit, shipped to every rank: JSON-able, so it travels
    as a file to a child process (Keras) as well as in a task's closure (torch). The pickled
    objects (model, optimizer, loss, metrics, callbacks, transformation_fn, the strategy
    class) travel separately as the payload."""

    # the materialized dataset (MaterializedDataset: root, files by split, column specs)
    dataset_root: str
    layouts: Dict[str, Any]  # split -> [[file, rows], ...]
    columns: List[Dict[str, Any]]  # ColumnSpec.to_json() of every column
    storage_options: Dict[str, Any] = field(default_factory=dict, repr=False)  # may hold keys
    # what the model reads and how
    feature_cols: List[str]
    label_cols: List[str]
    sample_weight_col: Optional[str] = None
    input_shapes: Optional[List[List[int]]] = None  # each feature reshaped to it (Horovod's)
    label_shapes: Optional[List[List[int]]] = None
    loss_weights: Optional[List[float]] = None
    # the loop
    batch_size: int
    val_batch_size: int
    epochs: int
    shuffle: bool
    seed: Optional[int]
    verbose: int
    backend: str  # the engine's registered name
    strategy: str  # the registered name (messages); the class travels in the payload
    backend_env: Optional[Dict[str, str]] = field(default=None, repr=False)
    # the fit's loop options (EstimatorBase._spec_fields)
    train_steps: Optional[int] = None
    val_steps: Optional[int] = None
    inmemory_cache_all: bool = False
    backward_passes_per_step: int = 1
    scale_learning_rate: bool = False
    mixed_precision: Optional[str] = None  # "bf16" | "fp16"
    deadline: Optional[float] = None  # time.time() after which training stops at an epoch end
    fit_id: str = ""  # the fit's attempts share it (see sparktrain.loop.epochs)
    run_path: str = ""  # the run's directory in the store: checkpoints, TensorBoard; "": none
    generation: Optional[Dict[str, Any]] = None  # an elastic fit's (launch.elastic.for_rank)
    # how the ranks read and decode (compat.reader_options)
    train_prefetch: int = 2  # row groups the readers decode ahead
    val_prefetch: int = 2
    reader_pool: str = "thread"  # "process": transformation_fn in decode worker processes
    train_decode_workers: int = 2
    val_decode_workers: int = 2
    mp_start_method: Optional[str] = None

    def model_columns(self) -> List[str]:
        """The batch columns the model, the loss and the sample weighting read."""
        weight = [self.sample_weight_col] if self.sample_weight_col else []
        return list(self.feature_cols) + list(self.label_cols) + weight

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls: Type[S], text: str) -> S:
        return cls(**json.loads(text))


@dataclass(kw_only=True)
class TorchTrainSpec(LoopSpec):
    """One torch fit's :class:`~sparktrain.loop.spec.LoopSpec`, plus the torch loop's own
    fields; ``strategy`` names one of :data:`sparktrain.strategies.TORCH_STRATEGIES`."""

    use_gpu: bool
    gradient_compression: Optional[str] = None  # "fp16" (Horovod's param, see TorchEstimator)
    output_key: Optional[str] = None  # the entry of a dict/ModelOutput result (torch_forward)
    lr_scheduler_interval: str = "step"  # when lr_scheduler steps (torch_schedule)


@dataclass(kw_only=True)
class KerasTrainSpec(LoopSpec):
    """One Keras fit's :class:`~sparktrain.loop.spec.LoopSpec`, plus what the Keras loop and
    the launchers add; written to the child process as JSON (``spec.json``)."""

    best_model: Optional[Dict[str, Any]] = None  # checkpoint_callback's settings, see keras_checkpoint
    strategy_options: Dict[str, Any] = field(default_factory=dict)  # KerasStrategy.check's
    # set by the launcher for each process
    rank: int = 0
    world_size: int = 1
    attempt: int = 0
    role: str = ""  # "": the training loop; else a serving role of the strategy's cluster
    launch_info: Dict[str, Any] = field(default_factory=dict)  # what the launch gathered
