"""Which row source a fit takes (the driver, once per fit, before any training job): see
:mod:`sparktrain.data.sources` for the ways.

Example::

    source = rows_to_ranks(df, store, columns, "stream", None, 1, variable_length=False,
                           num_proc=2, min_num_proc=2, fed=True, feed_dir=folder, spare=claim)
    source.plan.way          # "fed", "own", "shuffled" or "store"
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional, Sequence, Union

from sparktrain.data.columns import SPLIT_COL, ColumnSpec
from sparktrain.data.sources.contract import RowSource
from sparktrain.options.spec import RowsPlan

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from sparktrain.data.store import Store
    from sparktrain.session.slots import SlotClaim

log = logging.getLogger("sparktrain")


def rows_to_ranks(df: "DataFrame", store: "Store", columns: Sequence[ColumnSpec],
                  input_mode: str, validation: Union[None, float, str], seed: Optional[int], *,
                  variable_length: bool, num_proc: int, min_num_proc: int, fed: bool,
                  feed_dir: str, cache_limit: Optional[float] = None, ranks_per_task: int = 1,
                  spare: Optional["SlotClaim"] = None) -> RowSource:
    """The fit's row source, chosen once: the store (``input_mode="store"``, written now or
    an earlier write of the same plan reused: :func:`~sparktrain.data.materialize.materialize`);
    else streamed, nothing written: fed by jobs beside the ranks through ``feed_dir`` where
    the ranks can take them (``fed``) and the fit's slot claim (``spare``, :func:`~sparktrain.
    session.slots.claim_slots`) holds a slot to feed from; else taken by the training stage:
    each rank its own partition where the DataFrame has one a rank, the fit is not elastic,
    tasks run one rank and the columns are fixed-shape numbers (:mod:`.own_partition`), else
    after a shuffle (:mod:`.shuffled`).

    GPU ranks never get a feeding slot claimed: a feeding task of the application's profile
    may need GPUs that the ranks hold (``spark.task.resource.gpu.amount=4``: a machine's), and
    the ranks would wait for rows that never come."""
    if input_mode == "store":
        from sparktrain.data.materialize import materialize

        data = materialize(df, store, columns, validation, seed, variable_length=variable_length)
        return RowSource(RowsPlan("store", root=data.root, layouts=data.files), data.columns,
                         rows=data.rows, seconds=data.seconds, reused=data.reused)
    beside = fed and spare is not None and spare.spare
    if fed and not beside and spare is not None:
        log.info("input_mode='stream': num_proc=%d and what other fits and jobs hold now (%d "
                 "of %s task slots) leave none to feed the ranks while they train: each rank "
                 "takes its rows from the training stage (one partition a rank where the "
                 "DataFrame has num_proc partitions, else after a shuffle)", num_proc,
                 spare.busy, spare.slots)
    own = fed and not beside and min_num_proc == num_proc and ranks_per_task == 1
    return _streamed(df, columns, validation, seed, variable_length, min_num_proc,
                     feed_dir if beside else None, cache_limit, num_proc if own else None)


def _streamed(df: "DataFrame", columns: Sequence[ColumnSpec],
              validation: Union[None, float, str], seed: Optional[int], variable_length: bool,
              min_ranks: int, feed_dir: Optional[str], cache_limit: Optional[float],
              own_ranks: Optional[int]) -> RowSource:
    """``columns`` sized and checked as the store's dataset would be, nothing written: the
    rows in their stored form with their split, fed (``feed_dir``), each rank's own partition
    (``own_ranks``: when ``df`` has that many partitions and fixed-shape numeric columns), or
    shuffled in; counted per partition for the first two."""
    from pyspark.sql import functions as F

    from sparktrain.data.materialize import split_column
    from sparktrain.data.prepare import nullable_elements, prepared_column, sized_columns
    from sparktrain.data.rank_cache import cacheable
    from sparktrain.session.spark_api import num_partitions

    start = time.perf_counter()
    specs = sized_columns(df, columns, variable_length)
    nullable = {f.name: nullable_elements(f.dataType) for f in df.schema.fields}
    selected = [expr for spec in specs for expr in prepared_column(spec, nullable[spec.name])]
    split = split_column(df, validation, seed) or [F.lit("train").alias(SPLIT_COL)]
    frame = df.select(*selected, *split)
    own = own_ranks is not None and num_partitions(df) == own_ranks and cacheable(specs)
    if feed_dir is not None or own:
        from sparktrain.data.sources.fed_driver import counted_where, partition_counts
        from sparktrain.data.sources.fed_wire import CHUNK_ROWS, new_secret

        counts = partition_counts(frame)
        plan = RowsPlan("fed" if feed_dir is not None else "own", counts=counts,
                        chunk=CHUNK_ROWS, feed_dir=feed_dir or "", cache_limit=cache_limit,
                        secret=new_secret() if feed_dir is not None else "",
                        homes=counted_where(frame, counts) if feed_dir is not None else [])
        there = sum(counts.get("train", []))
    else:
        from sparktrain.data.sources.trained_rows import ROW_ID

        plan = RowsPlan("shuffled")
        there = frame.limit(min_ranks).count()  # a cheap check that the ranks get rows
        # each row's partition and offset before the shuffle: where a resume finds it
        frame = frame.withColumn(ROW_ID, F.monotonically_increasing_id())
    if there < min_ranks:
        raise ValueError(f"input_mode='stream' gives each of the {min_ranks} ranks its own "
                         f"rows, and the DataFrame has fewer rows than that; use fewer ranks "
                         f"(num_proc) or more rows")
    return RowSource(plan, specs, seconds=time.perf_counter() - start, frame=frame)


def check_streamable(input_mode: str, own_rows: bool, what: str) -> None:
    """Refuse ``input_mode='stream'`` before any job where the tasks of ``what`` (a backend and
    strategy) do not all train on the rows they are given (``own_rows``)."""
    if input_mode == "stream" and not own_rows:
        raise ValueError(f"input_mode='stream' is not available with {what} (their tasks do "
                         f"not all train on their own rows); use input_mode='store'")
