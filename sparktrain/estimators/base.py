"""What every sparktrain estimator shares, whatever the framework (models: :mod:`.model`).

``fit`` = check params and schema (no Spark job) -> check task slots -> materialize the columns
to the store (reused for the same plan) -> the framework's ``_train`` in barrier tasks -> a
model. Subclasses add the framework: ``_check_framework``, ``_train``, the model class.

Example::

    class TorchEstimator(EstimatorBase, TorchParams):
        backends, framework, options = TORCH_BACKENDS, "torch", COMMON + TORCH
"""
from __future__ import annotations

import logging
import time
import uuid
import warnings
from contextlib import ExitStack
from typing import Any, Callable, Dict, List, Optional, Tuple

from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame, SparkSession

from sparktrain.data.batch import heavy_decoding
from sparktrain.data.columns import BINARY, IMAGE, RAW_KINDS, STRING, VARLEN, ColumnSpec
from sparktrain.data.materialize import lease_seconds
from sparktrain.data.run_lock import run_lock
from sparktrain.data.schema import check_validation_column, training_columns
from sparktrain.data.sources.choose import rows_to_ranks
from sparktrain.data.sources.contract import RowSource
from sparktrain.data.store import Store
from sparktrain.estimators.fit_run import FitRun
from sparktrain.estimators.model import ModelBase
from sparktrain.estimators.persistence import EstimatorReader, EstimatorWriter
from sparktrain.estimators.prediction import check_profiles, takes_profiles
from sparktrain.estimators.preflight import run_preflight, transformation_columns
from sparktrain.estimators.progress import FitProgress, TqdmLogHandler, interval_from_conf
from sparktrain.fit_hooks import FitListener, fit_hooks
from sparktrain.launch import Entry, check_backend
from sparktrain.launch.barrier import check_slots
from sparktrain.launch.elastic import ElasticPlan
from sparktrain.launch.executor_env import RANK_MODULES, check_executors, store_modules
from sparktrain.launch.gpus import GpuPlan, plan_gpus
from sparktrain.loop.checkpoint import Checkpoints
from sparktrain.options import horovod as horovod_params
from sparktrain.options.declarations import COMMON, Option
from sparktrain.options.params import EstimatorParams, camel
from sparktrain.session.interrupts import interruptible, raise_if_interrupted
from sparktrain.session.slots import SlotClaim, claim_slots
from sparktrain.session.spark_api import (
    all_conf,
    check_store_shared,
    hdfs_settings,
    job_tag,
    master,
)

log = logging.getLogger("sparktrain")


_KIND_TEXT = {BINARY: "binary (bytes)", STRING: "a string column", IMAGE: "an image struct",
              VARLEN: "an array column of variable length"}
_KIND_FORM = {BINARY: "an object array of bytes", STRING: "an object array of str",
              IMAGE: "an object array of uint8 (H, W, C) RGB arrays",
              VARLEN: "an object array of 1-D arrays"}


class _FitLogging:
    """Show sparktrain's INFO lines (epoch progress, rank logs) on stderr during a fit with
    ``verbose >= 1`` when the application has not configured logging itself (printed above
    the progress bar; off a terminal they are the progress, see
    :mod:`sparktrain.estimators.progress`)."""

    def __init__(self, verbose: int) -> None:
        self.handler: Optional[logging.Handler] = None
        if verbose >= 1 and not log.handlers and not logging.getLogger().handlers:
            self.handler = TqdmLogHandler()
            self.handler.setFormatter(logging.Formatter("[sparktrain] %(message)s"))

    def __enter__(self) -> None:
        if self.handler is not None:
            self._level = log.level
            log.addHandler(self.handler)
            log.setLevel(logging.INFO)

    def __exit__(self, *exc: object) -> None:
        if self.handler is not None:
            log.removeHandler(self.handler)
            log.setLevel(self._level)


class EstimatorBase(Estimator, EstimatorParams, MLWritable, MLReadable):
    """Framework-independent ``fit``; see the module docstring."""

    #: backend name -> ("module:Class" or the class, requirement), set by each framework's
    #: estimator
    backends: Dict[str, Tuple[Entry, str]] = {}
    #: what the framework's checkpoints are tagged with ("torch", "keras")
    framework = ""
    #: the estimator's options (sparktrain.options.declarations): its Params and keywords
    options: Tuple[Option, ...] = COMMON

    def _check_framework(self) -> None:
        """Raise ``ValueError``/``TypeError`` for framework params that cannot work."""
        raise NotImplementedError

    def _train(self, run: FitRun) -> Dict[str, Any]:
        """Run training in barrier tasks; return rank 0's result."""
        raise NotImplementedError

    def _check_session(self, spark: SparkSession) -> None:
        """Raise ``ValueError`` before any job if the backend cannot run on this session."""

    def _check_on_batch(self, batch: Dict[str, Any]) -> None:
        """Preflight: run the model, loss and metrics on ``batch`` (a few real rows, numpy by
        column name as training reads them) on the driver; raise ``PreflightError``."""

    def _built_elsewhere(self, name: str) -> bool:
        """True when the required param ``name`` may stay unset because the framework gets it
        another way (torch: losses from ``loss_constructors``; Keras: a compiled model's
        optimizer)."""
        return False

    def _executor_modules(self) -> List[str]:
        """Import names every executor's Python must find for this fit (checked up front)."""
        requirement = self.backends[self.getBackend()][1]
        return list(RANK_MODULES) + [requirement] + (["keras"] if self.framework == "keras"
                                                     else [])

    def elastic_plan(self) -> ElasticPlan:
        """The fit's :class:`~sparktrain.launch.elastic.ElasticPlan` (raises ``ValueError`` for
        a ``min_num_proc`` outside ``[1, num_proc]``)."""
        return ElasticPlan(num_proc=self.getNumProc(), min_num_proc=self.getMinNumProc(),
                           batch=self.getElasticBatch())

    def _spec_fields(self, run: Optional[FitRun] = None) -> Dict[str, Any]:
        """The spec fields (:mod:`sparktrain.options.spec`) of the options the ranks read (their
        getters' values) and of ``run``; the framework adds what it derives. Without ``run``:
        the preflight's, with no dataset and no run directory."""
        fields = {o.spec_name: getattr(self, f"get{camel(o.name)}")()
                  for o in self.options if o.spec_name is not None}  # None: not o.rank
        if run is None:
            return dict(fields, columns=[], **horovod_params.reader_options(self))
        max_time = self.getMaxTime()
        return dict(fields, rows=run.data.plan, columns=[c.to_json() for c in run.data.columns],
                    storage_options=run.store.storage_options, run_path=run.run_path,
                    fit_id=run.fit_id, deadline=run.started + max_time if max_time else None,
                    **horovod_params.reader_options(self, raw=heavy_decoding(run.data.columns)))

    def _create_model(self, result: Dict[str, Any], dataset: RowSource) -> "ModelBase":
        raise NotImplementedError

    # -- fit ------------------------------------------------------------------------------------
    #: whether the ranks can take rows fed by jobs beside them (their readers run where the
    #: Spark task's ``all_gather`` is; Keras's run in a child process and read a spooled shard)
    fed_streams = False
    # a task holding N GPUs runs N ranks, one process each (torch); else one worker using
    # all N (Keras: MultiWorkerMirroredStrategy spans a worker's GPUs)
    ranks_per_gpu = False

    def _rows_to_ranks(self, df: DataFrame, store: Store, specs: List[ColumnSpec],
                       validation: Any, elastic: ElasticPlan, feed_dir: str, gpus: GpuPlan,
                       claim: SlotClaim) -> RowSource:
        """The fit's row source (:func:`~sparktrain.data.sources.choose.rows_to_ranks`)."""
        return rows_to_ranks(df, store, specs, self.getInputMode(), validation,
                             self.getRandomSeed(),
                             variable_length=self.getTransformationFn() is not None,
                             num_proc=elastic.num_proc, min_num_proc=elastic.min_num_proc,
                             fed=self.fed_streams, feed_dir=feed_dir,
                             cache_limit=self.getCacheLimit(),
                             ranks_per_task=gpus.ranks_per_task,
                             spare=None if gpus.use_gpu else claim)

    def _check_params(self, df: DataFrame) -> List[ColumnSpec]:
        """What spans several options, the estimator or the DataFrame (each option's own range
        or choices were checked when it was set: its converter in
        :mod:`sparktrain.options.declarations`); the columns to feed."""
        self.elastic_plan()  # min_num_proc within [1, num_proc]
        fn = self.getTransformationFn()
        backend = self.getBackend()
        if backend not in self.backends:
            raise ValueError(f"backend must be one of {sorted(self.backends)} for "
                             f"{type(self).__name__}, got {backend!r}")
        check_backend(self.backends, backend)
        if not self.isDefined(self.feature_cols):
            raise ValueError("feature_cols is not set; name the DataFrame columns to feed the "
                             "model")
        for name in ("model", "optimizer", "loss"):
            if (not self.isDefined(name) or self.getOrDefault(name) is None) \
                    and not self._built_elsewhere(name):
                raise ValueError(f"{name} is not set; pass {name}=... to {type(self).__name__}")
        wanted = self.getFeatureCols() + self.getLabelCols() + \
            ([self.getSampleWeightCol()] if self.getSampleWeightCol() else [])
        created = [name for name in wanted if name not in df.columns] if fn is not None else []
        specs = training_columns(df, self.getFeatureCols(), self.getLabelCols(),
                                 self.getSampleWeightCol(), created)
        validation = self.getValidation()
        if isinstance(validation, str):
            check_validation_column(df, validation)
        if fn is None:
            raw = [s for s in specs if s.kind in RAW_KINDS]
            if raw:
                spec = raw[0]
                role = "feature" if spec.name in self.getFeatureCols() else "label"
                raise ValueError(
                    f"{role} column {spec.name!r} is {_KIND_TEXT[spec.kind]}; a model takes "
                    f"numbers: "
                    f"pass transformation_fn=... that turns it into numeric arrays of one "
                    f"shape (it gets {_KIND_FORM[spec.kind]}; docs/data.md, 'Images, "
                    f"text and sequences')")
        self._check_framework()
        if created:  # and the DataFrame columns the transformation reads to make them
            present = [spec.name for spec in specs]
            inputs = transformation_columns(df, fn, wanted, keep=present)
            assert inputs is not None  # it returns a list on every path
            specs += [spec for spec in inputs if spec.name not in present]
        return specs

    def _fit(self, dataset: DataFrame) -> "ModelBase":
        # the registered fit hooks (MLflow, docs/mlflow.md: it does nothing unless the fit is
        # logged) wrap the fit: plug-ins follow fits without this module importing them
        spark = dataset.sparkSession
        tag = f"sparktrain-fit-{uuid.uuid4().hex[:12]}"  # every Spark job of this fit
        with fit_hooks(self) as listener, \
                interruptible(spark, tag, f"{type(self).__name__}.fit"), job_tag(spark, tag):
            return self._fit_tracked(dataset, listener)

    def _fit_tracked(self, dataset: DataFrame, listener: FitListener) -> "ModelBase":
        with _FitLogging(self.getVerbose()):  # shows what the transformation's columns are
            specs = self._check_params(dataset)
        spark = dataset.sparkSession
        self._check_session(spark)
        gpus, profile = self._gpu_plan(dataset)
        if self.getMixedPrecision() == "fp16" and not gpus.use_gpu:
            raise ValueError("mixed_precision='fp16' needs GPU ranks (CPU autocast supports "
                             "bfloat16 only); use mixed_precision='bf16' or train on GPUs")
        elastic = self.elastic_plan()
        gpus.tasks(elastic.num_proc)  # whole tasks of ranks (one per GPU)
        with _FitLogging(self.getVerbose()):  # a wait for executors starting logs its progress
            check_slots(spark, elastic.min_num_proc,
                        name="min_num_proc" if elastic.elastic else "num_proc",
                        profile=profile, ranks_per_task=gpus.ranks_per_task)
            run_preflight(self, dataset, specs)
        raise_if_interrupted()
        # hdfs:///p resolved here, with this driver's Hadoop settings: executors and ranks
        # need no HADOOP_CONF_DIR of their own to reach the same place
        store = Store.create(self.getStore())
        if store.on_hdfs:
            store = store.resolved(hdfs_settings(spark))
        # before any job writes a row: the fit's packages and the store's client, on executors
        check_executors(spark, self._executor_modules() + store_modules(store.prefix),
                        f"{type(self).__name__}(backend={self.getBackend()!r}, "
                        f"store={store.prefix!r})")
        check_store_shared(spark, store)
        validation = self.getValidation() or None
        # uid + time + random: copies of one estimator (CrossValidator) never share a run.
        run_id = self.getRunId() or \
            f"{self.uid}_{time.strftime('%Y%m%d-%H%M%S')}_{uuid.uuid4().hex[:6]}"
        listener.started(run_id, store, spark)
        with _FitLogging(self.getVerbose()), ExitStack() as stack, \
                FitProgress(self.getVerbose(), interval=interval_from_conf(spark),
                            listeners=[listener.on_progress]) as progress:
            started = time.perf_counter()
            stack.enter_context(run_lock(store, run_id, lease_seconds(spark)))
            latest = Checkpoints(store.run_path(run_id), store.storage_options).latest()
            if latest is not None and latest.meta.get("framework") != self.framework:
                raise ValueError(f"run_id={run_id!r} holds a {latest.meta.get('framework')} "
                                 f"run's checkpoints; {type(self).__name__} cannot resume it. "
                                 f"Pass another run_id.")
            if latest is not None:
                log.info("run %s has a checkpoint after epoch %d: resuming from it", run_id,
                         latest.epochs_done)
            raise_if_interrupted()
            # the training stage's slots, and one to feed its ranks where one is left over
            # every other fit and job (else two fits can wait on each other for ever)
            claim = stack.enter_context(claim_slots(
                spark, -(-elastic.num_proc // gpus.ranks_per_task),
                feeders=self.fed_streams and self.getInputMode() == "stream"
                and not gpus.use_gpu))
            data = self._rows_to_ranks(dataset, store, specs, validation, elastic,
                                       f"{store.run_path(run_id)}/_feed/{uuid.uuid4().hex[:8]}",
                                       gpus, claim)
            raise_if_interrupted()
            result = self._train(FitRun(dataset.sparkSession, data, store, gpus, run_id,
                                        progress, time.time(), elastic, profile))
            listener.trained(result)
            progress.close()
            log.info("fit done in %.1fs (materialize %.1fs%s); run %s",
                     time.perf_counter() - started, data.seconds,
                     ", reused" if data.reused else "", store.run_path(run_id))
        if result.get("stop_reason") == "max_time":
            epochs_done = len(next(iter(result["history"].values()), []))
            warnings.warn(f"training stopped after {epochs_done} of {self.getEpochs()} epochs: "
                          f"max_time={self.getMaxTime():g}s reached. "
                          f"The model is the last epoch's; fit again with run_id={run_id!r} to "
                          f"continue from its checkpoint.", RuntimeWarning, stacklevel=3)
        model = self._create_model(result, data)
        model._set(feature_cols=self.getFeatureCols(), label_cols=self.getLabelCols(),
                   run_id=run_id, use_gpu=self.getUseGpu(),
                   predict_transformation_fn=self._prediction_transform(data))
        listener.fitted(model, dataset)
        return model

    def _gpu_plan(self, dataset: DataFrame) -> Tuple[GpuPlan, Any]:
        """How the training stage gets its GPUs (:func:`~sparktrain.launch.gpus.plan_gpus`)
        and the ResourceProfile it runs with (``None``: the application's defaults)."""
        spark, conf = dataset.sparkSession, all_conf(dataset.sparkSession)
        profile = self.getResourceProfile()
        if profile is not None:
            check_profiles(dataset)
        plan = plan_gpus(conf, master(spark), spark.version, self.getUseGpu(), profile,
                         self.ranks_per_gpu, takes_profiles(dataset))
        if plan.needs_profile:
            profile = plan.build_profile()
            log.info("the training stage asks for 1 GPU and %d CPU(s) per rank (stage-level "
                     "scheduling); the application's other stages keep "
                     "spark.task.resource.gpu.amount=%s", plan.profile_cpus,
                     conf.get("spark.task.resource.gpu.amount", "unset"))
        if plan.ranks_per_task > 1:
            log.info("each task holds %d GPUs and runs %d ranks, one process per GPU",
                     plan.gpus_per_task, plan.ranks_per_task)
        return plan, profile

    def _prediction_transform(self, data: RowSource) -> Optional[Callable]:
        """What the model applies before predicting: ``predict_transformation_fn``, else
        ``transformation_fn`` when a feature column is of a raw kind (bytes, text, images,
        variable-length arrays: the model cannot predict without decoding them), else none
        (numeric features predict as they are, as in Horovod)."""
        given = self.getPredictTransformationFn()
        if given is not None:
            return given
        features = set(self.getFeatureCols())
        stored = {c.name for c in data.columns}
        if any(c.kind in RAW_KINDS for c in data.columns if c.name in features) or \
                not features <= stored:  # raw, or made by the transformation
            return self.getTransformationFn()
        return None

    def _prediction_columns(self, data: RowSource) -> List[ColumnSpec]:
        """The DataFrame columns the model reads to predict: the feature columns, or (when
        ``transformation_fn`` creates them) the columns it reads, labels and weights left out
        (docs/data.md, 'Columns a transformation creates')."""
        features = set(self.getFeatureCols())
        targets = set(self.getLabelCols()) | {self.getSampleWeightCol()}
        return [c for c in data.columns if c.name in features or c.name not in targets]

    # -- persistence ----------------------------------------------------------------------------
    def write(self) -> EstimatorWriter:
        return EstimatorWriter(self)

    @classmethod
    def read(cls) -> EstimatorReader:
        return EstimatorReader(cls)
