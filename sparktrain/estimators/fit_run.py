"""One fit's launch: what the driver decided before training (the data, the store, the run,
the ranks) and how the framework's ``_train`` starts its ranks with it.

Example (inside an estimator's ``_train``)::

    with run.shipped(payload) as (stored, where):
        results = run.launch(functools.partial(train_rank, spec, stored), **where)
"""
from __future__ import annotations

import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Tuple

from pyspark.sql import SparkSession

from sparktrain.data.sources.contract import RowSource
from sparktrain.data.store import Store, StoredBytes
from sparktrain.estimators.progress import FitProgress
from sparktrain.launch.elastic import ElasticPlan, run_elastic
from sparktrain.launch.gpus import GpuPlan


@dataclass
class FitRun:
    """Everything one fit's launch needs, decided on the driver before training starts."""

    spark: SparkSession
    data: RowSource
    store: Store
    gpus: GpuPlan  # how the training stage gets its GPUs (launch.gpus.plan_gpus)
    run_id: str
    progress: FitProgress
    started: float  # time.time() when fit began: max_time counts from here, across retries
    elastic: ElasticPlan  # how many ranks (num_proc, min_num_proc: launch.elastic)
    # the training stage's ResourceProfile (stage-level scheduling: the plan's, or the user's)
    profile: Any = None
    # one fit, whatever its attempts: an early stop it checkpointed holds for its retries only
    fit_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def use_gpu(self) -> bool:
        return self.gpus.use_gpu

    @property
    def ranks_per_task(self) -> int:
        """Ranks each barrier task runs (one process per GPU: :mod:`~sparktrain.launch.
        local_ranks`)."""
        return self.gpus.ranks_per_task

    @property
    def run_path(self) -> str:
        """The run's directory in the store (checkpoints, TensorBoard events)."""
        return self.store.run_path(self.run_id)

    def launch(self, task: Callable[[Any], Any], **options: Any) -> List[Any]:
        """Run ``task`` on the fit's ranks, in generations when the fit is elastic; results in
        rank order (``options``: :func:`~sparktrain.launch.barrier.run_barrier`'s)."""
        with self.data.reaching_ranks(self.spark, self.store.storage_options) as stage_input:
            rows: Dict[str, Any] = {"stage_input": stage_input} if stage_input is not None else {}
            return run_elastic(self.spark, self.elastic, task, on_progress=self.progress.update,
                               **options, **rows, **self.stage())

    def stage(self) -> Dict[str, Any]:
        """The barrier stage's resources as :func:`~sparktrain.launch.barrier.run_barrier`
        options (none where the application's defaults hold)."""
        return {**({"profile": self.profile} if self.profile is not None else {}),
                **({"ranks_per_task": self.ranks_per_task} if self.ranks_per_task > 1 else {})}

    @contextmanager
    def shipped(self, payload: bytes) -> Iterator[Tuple[StoredBytes, Dict[str, Any]]]:
        """``payload`` (the pickled model, optimizer, loss...) written to the run's directory
        in the store for the ranks to read, and the :func:`~sparktrain.launch.barrier.
        run_barrier` options that put the launch's events next to it; both deleted after."""
        workdir = f"{self.run_path}/_launch"
        options = self.store.storage_options
        stored = StoredBytes.put(f"{workdir}/payload-{uuid.uuid4().hex[:8]}.pkl", payload,
                                 options)
        try:
            yield stored, {"workdir": workdir, "storage_options": options}
        finally:
            stored.delete()
