"""Params of elastic training (docs/long-runs-and-faults.md, "Elastic training";
:mod:`sparktrain.launch.elastic`): ``min_num_proc`` (the fewest ranks; ``num_proc`` is the
most) and ``elastic_batch`` (what a generation with fewer ranks keeps: the global batch or the
per-rank one).

Example::

    TorchEstimator(num_proc=8, min_num_proc=4, ...)      # trains on 4 to 8 ranks
"""
from __future__ import annotations

from pyspark.ml.param import Param, Params, TypeConverters

from sparktrain.launch.elastic import BATCH_RULES, ElasticPlan
from sparktrain.options.converters import to_choice


class ElasticParams(Params):
    """``min_num_proc`` and ``elastic_batch`` (see the module)."""

    min_num_proc = Param(Params._dummy(), "min_num_proc",
                         "the fewest training processes of an elastic fit (default: num_proc, "
                         "not elastic): the fit starts with the free task slots up to num_proc, "
                         "continues with fewer ranks when a machine is lost and grows back",
                         TypeConverters.toInt)
    elastic_batch = Param(Params._dummy(), "elastic_batch",
                          "'global' (default): a generation with fewer ranks keeps the global "
                          "batch batch_size * num_proc (larger batches per rank); 'rank': it "
                          "keeps batch_size per rank", to_choice("elastic_batch", BATCH_RULES))

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(min_num_proc=None, elastic_batch="global")

    def getMinNumProc(self) -> int:
        """``min_num_proc``, or ``num_proc`` where it is not set."""
        value = self.getOrDefault(self.min_num_proc)
        return self.getOrDefault("num_proc") if value is None else value

    def getElasticBatch(self) -> str:
        return self.getOrDefault(self.elastic_batch)

    def elastic_plan(self) -> ElasticPlan:
        """The fit's :class:`~sparktrain.launch.elastic.ElasticPlan` (raises ``ValueError`` for
        a ``min_num_proc`` outside ``[1, num_proc]``)."""
        return ElasticPlan(num_proc=self.getOrDefault("num_proc"),
                           min_num_proc=self.getMinNumProc(), batch=self.getElasticBatch())
