"""The plain values every rank loop trains by, whatever the framework.

:class:`LoopSpec` holds what both loops (:mod:`sparktrain.loop.torch_loop`,
:mod:`sparktrain.loop.keras_loop`) read: the materialized data, the model's columns and
shapes, the epoch settings the shared driver (:class:`sparktrain.loop.epochs.EpochDriver`)
takes, and how the ranks read and decode. Each framework's spec extends it with its own fields
(``TorchTrainSpec``, ``KerasTrainSpec``). The fields of the options the ranks read come from
their declarations (:mod:`sparktrain.options.declarations`, ``rank=``): the estimator fills
them from its params (``EstimatorBase._spec_fields``); the others are declared here.

It lives with the options it is made from, below every layer that reads it (data, launch,
strategies, the rank loops, the estimators), and imports only the standard library and the
declarations: the launchers, the Keras child process and the estimators all import it without
pulling in a framework or ``pyspark.ml``. Fields are keyword-only, so a framework's spec can
add required fields after defaulted ones. The objects that travel pickled beside it are the
payload (:mod:`sparktrain.options.payload`).

Example::

    spec = TorchTrainSpec(**estimator._spec_fields(run), strategy="ddp", use_gpu=True)
    spec = KerasTrainSpec.from_json(spec_text)       # in the Keras child process
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Type, TypeVar

from sparktrain.options.declarations import COMMON, KERAS, TORCH, UNSET, Option

S = TypeVar("S", bound="LoopSpec")
C = TypeVar("C", bound=type)


def option_fields(options: Sequence[Option]) -> Callable[[C], C]:
    """A class decorator (under ``@dataclass``) adding a field per option the ranks read,
    named by its ``spec_name``, with its default (required where it has none)."""
    def add(cls: C) -> C:
        annotations = cls.__dict__.get("__annotations__", {})
        for option in options:
            if option.spec_name is None:
                continue
            annotations[option.spec_name] = option.hint
            if option.default is UNSET:
                continue
            default = option.default
            value = {"default_factory": lambda v=default: copy.deepcopy(v)} \
                if isinstance(default, (list, dict)) else {"default": default}
            setattr(cls, option.spec_name, field(repr=not option.hidden, **value))
        cls.__annotations__ = annotations
        return cls
    return add


WAYS = ("store", "fed", "own", "shuffled")


@dataclass
class RowsPlan:
    """How a fit's rows reach its ranks: which row source (``way``, one module each in
    :mod:`sparktrain.data.sources`) and what its rank half needs, as plain values (it travels
    in the spec, as JSON to a Keras child process too).

    Example::

        RowsPlan("store", root="/st/datasets/ab12/attempts/x", layouts={"train": [...]})
        RowsPlan("fed", counts={"train": [500, 500]}, chunk=1024, feed_dir="/st/runs/r/_feed/a")
    """

    way: str = "store"  # one of WAYS
    root: str = ""  # store: the dataset's directory
    layouts: Dict[str, Any] = field(default_factory=dict)  # store: split -> [[file, [rows]]]
    counts: Dict[str, List[int]] = field(default_factory=dict)  # fed, own: rows per partition
    chunk: int = 0  # fed: rows dealt to one rank at a time
    feed_dir: str = ""  # fed: the feed folder (sparktrain.data.sources.fed_wire.FeedFolder)
    cache_limit: Optional[float] = None  # fed, own: what the rank cache may take
    # shuffled, read in a Keras child process: the files its task spooled, split -> [path,
    # rows per epoch] (sparktrain.data.sources.shuffled)
    spooled: Optional[Dict[str, List[Any]]] = None
    # fed: the fit's key, which feeders prove to the ranks' receivers (fed_wire's lock); in
    # the fit's payload only, never in the store or a repr
    secret: str = field(default="", repr=False)
    # fed: the host where Spark computed each partition when it was counted ("" unknown): the
    # ranks there get its rows (sparktrain.data.sources.fed_wire.host_targets)
    homes: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.way not in WAYS:
            raise ValueError(f"RowsPlan.way must be one of {WAYS}, got {self.way!r}")


@dataclass(kw_only=True)
@option_fields(COMMON)
class LoopSpec:
    """Plain-valued description of one fit, shipped to every rank: JSON-able, so it travels
    as a file to a child process (Keras) as well as in a task's closure (torch). The pickled
    objects (model, optimizer, loss, metrics, callbacks, transformation_fn, the strategy
    and engine classes) travel separately as the payload (:mod:`sparktrain.options.payload`).
    Besides the fields below: one per option in ``COMMON`` that the ranks read
    (``batch_size``, ``epochs``, ``seed``, ...)."""

    # how the rows reach the ranks (the fit's row source, sparktrain.data.sources)
    rows: RowsPlan = field(default_factory=RowsPlan)
    columns: List[Dict[str, Any]]  # ColumnSpec.to_json() of every column
    storage_options: Dict[str, Any] = field(default_factory=dict, repr=False)  # may hold keys
    input_shapes: Optional[List[List[int]]] = None  # each feature reshaped to it (Horovod's)
    # the registered name (messages; the class travels in the payload): each framework's
    # options declare it with the framework's default
    strategy: str
    # the fit's run
    deadline: Optional[float] = None  # time.time() after which training stops at an epoch end
    fit_id: str = ""  # the fit's attempts share it (see sparktrain.loop.epochs)
    run_path: str = ""  # the run's directory in the store: checkpoints, TensorBoard; "": none
    generation: Optional[Dict[str, Any]] = None  # an elastic fit's (launch.elastic.for_rank)
    # how the ranks read and decode (sparktrain.options.horovod.reader_options)
    train_prefetch: int = 2  # row groups the readers decode ahead
    val_prefetch: int = 2
    reader_pool: str = "thread"  # "process": transformation_fn in decode worker processes
    train_decode_workers: int = 2
    val_decode_workers: int = 2
    mp_start_method: Optional[str] = None

    if TYPE_CHECKING:  # the option fields (option_fields) are added when the class is made
        def __getattr__(self, name: str) -> Any: ...

    def model_columns(self) -> List[str]:
        """The batch columns the model, the loss and the sample weighting read."""
        weight = [self.sample_weight_col] if self.sample_weight_col else []
        return list(self.feature_cols) + list(self.label_cols) + weight

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls: Type[S], text: str) -> S:
        fields = json.loads(text)
        fields["rows"] = RowsPlan(**fields.get("rows", {}))
        return cls(**fields)


@dataclass(kw_only=True)
@option_fields(TORCH)
class TorchTrainSpec(LoopSpec):
    """One torch fit's :class:`LoopSpec`, plus the fields of the ``TORCH`` options the torch
    loop reads (``strategy``, one of :data:`sparktrain.strategies.TORCH_STRATEGIES`,
    ``output_key``, ``lr_scheduler_interval``) and what the estimator derives."""

    use_gpu: bool
    gradient_compression: Optional[str] = None  # "fp16" (Horovod's param, see TorchEstimator)


@dataclass(kw_only=True)
@option_fields(KERAS)
class KerasTrainSpec(LoopSpec):
    """One Keras fit's :class:`LoopSpec`, plus the ``KERAS`` options the Keras loop reads
    (``strategy``) and what the estimator and the launchers add; written to the child process
    as JSON (``spec.json``)."""

    # checkpoint_callback's settings, see keras_checkpoint
    best_model: Optional[Dict[str, Any]] = None
    strategy_options: Dict[str, Any] = field(default_factory=dict)  # KerasStrategy.check's
    # set by the launcher for each process
    rank: int = 0
    world_size: int = 1
    attempt: int = 0
    role: str = ""  # "": the training loop; else a serving role of the strategy's cluster
    launch_info: Dict[str, Any] = field(default_factory=dict)  # what the launch gathered
