"""Row sources: the ways a fit's rows reach its ranks, one module each, chosen once per fit.

=================  ==========================================================================
way (``RowsPlan``)  module
=================  ==========================================================================
``"store"``        a Parquet dataset in the store, written once per plan
                   (``input_mode="store"``, :mod:`sparktrain.data.materialize`); each rank
                   reads its shard of it (:mod:`sparktrain.data.reader`)
``"fed"``          fed beside the ranks: :mod:`.fed_driver` (the driver's feeding jobs),
                   :mod:`.fed_wire` (the feed folder and the rows over TCP, both ends),
                   :mod:`.fed_rank` (a rank's receiver, cache and readers)
``"own"``          :mod:`.own_partition`: each rank's training task reads its own partition
``"shuffled"``     :mod:`.shuffled`: shuffled into the training stage, spooled by each rank
=================  ==========================================================================

Each source has a driver half, :class:`~.contract.RowSource` (what the fit enters while its
ranks train: the feeding jobs, or the rows the training stage takes, a
:class:`~.contract.StageInput`), and a typed plan (:class:`~sparktrain.options.spec.RowsPlan`,
in the spec) from which its rank half makes :class:`~.contract.RowReader` s
(:func:`rank_readers`). The launch sees an opaque stage input and never a row. The contracts
are in :mod:`.contract`, the choice of a source (:func:`~.choose.rows_to_ranks`) in
:mod:`.choose`.

Example (driver, then a rank)::

    source = rows_to_ranks(df, store, columns, "stream", None, 1, num_proc=2, ...)
    with source.reaching_ranks(spark, {}) as stage_input:
        run_barrier(spark, 2, task, stage_input=stage_input)
    readers = rank_readers(spec, ctx.rank, ctx.world_size, ctx.task_input, ctx.all_gather)
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, cast

from sparktrain.data.sources.contract import RowReader, TakenRows, TaskInput
from sparktrain.options.spec import LoopSpec


def rank_readers(spec: LoopSpec, rank: int, world_size: int,
                 task_input: Optional[TaskInput] = None,
                 all_gather: Optional[Callable[[str], List[str]]] = None,
                 say: Optional[Callable[[str], None]] = None,
                 hosts: Sequence[str] = ()) -> Dict[str, RowReader]:
    """This rank's readers (``{split: reader}``) from its source's plan (``spec.rows``): the
    store's shards, the rows fed to it (agreeing with the other ranks through
    ``all_gather``; ``hosts``: every rank's executor address, this rank's where its receiver
    listens), or
    the rows its task took (``task_input``; ``spec.rows.spooled``: a Keras child reading what
    its task spooled)."""
    way = spec.rows.way
    if way == "store":
        from sparktrain.data.reader import shard_readers

        return dict(shard_readers(spec, rank, world_size))
    if way == "fed":
        from sparktrain.data.sources.fed_rank import FedRows

        if all_gather is None:
            raise RuntimeError("rows fed beside the ranks need the ranks' all_gather")
        return dict(FedRows(spec, rank, world_size, all_gather, say, hosts).readers)
    if way == "shuffled" and spec.rows.spooled:
        from sparktrain.data.sources.shuffled import streamed_readers

        return dict(streamed_readers(spec, spec.rows.spooled, rank))
    if task_input is None or all_gather is None:
        raise RuntimeError(f"input_mode='stream' ({way}) but this rank's task took no rows")
    return cast(TakenRows, task_input).readers(spec, rank, world_size, all_gather, say)
