"""A long generation job that survives a failure: answers written slice by slice, each slice
a job of its own, and a rerun answers only the ids not written yet.

Example::

    answer_into(generator, questions, "s3://bucket/answers", id_col="id", slices=8)
    # after a failure, the same call answers only the rows still missing
"""
from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def written_ids(spark: Any, path: str, id_col: str) -> Any:
    """The ids already answered at ``path`` (a DataFrame), or ``None`` where nothing is."""
    from pyspark.errors import AnalysisException

    try:
        return spark.read.parquet(path).select(id_col)
    except AnalysisException:  # no such path yet
        return None


def answer_into(generator: Any, df: DataFrame, path: str, id_col: str,
                slices: int = 8) -> int:
    """Answer ``df``'s rows with ``generator`` into Parquet at ``path`` (``id_col`` and the
    generator's output columns), appending one slice of the ids at a time; ids already at
    ``path`` are skipped. A slice whose job fails leaves nothing behind (Spark commits a write
    as a whole), so a rerun after any failure answers every row exactly once. Returns the
    number of slices written by this call."""
    if id_col not in df.columns:
        raise ValueError(f"id_col {id_col!r} is not a column of the DataFrame; its columns: "
                         f"{sorted(df.columns)}")
    if slices < 1:
        raise ValueError(f"slices must be >= 1, got {slices}")
    done = written_ids(df.sparkSession, path, id_col)
    todo = df if done is None else df.join(done, id_col, "left_anti")
    output = generator.getOrDefault("outputCol")
    written = 0
    for part in range(slices):
        chunk = todo.where(F.pmod(F.hash(F.col(id_col)), F.lit(slices)) == part)
        answered = generator.transform(chunk).select(id_col, f"{output}.*")
        answered.write.mode("append").parquet(path)
        written += 1
    return written
