"""The errors and warnings a fit raises to its caller, in one leaf module every layer may import.

Example::

    from sparktrain.errors import TrainingError
    try:
        model = estimator.fit(df)
    except TrainingError as error:
        print(error.rank, error.remote_traceback)
"""
from __future__ import annotations

from typing import Optional, Sequence


class TrainingError(RuntimeError):
    """A training rank failed; ``rank`` and ``remote_traceback`` say where and how."""

    def __init__(self, message: str, rank: Optional[int] = None, remote_traceback: str = "",
                 attempts: int = 1) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.attempts = attempts  # attempts of the training stage that failed
        self.user_error = False  # raised by the user's code: retrying cannot help


class PreflightError(ValueError):
    """The model, loss or metrics failed on a few real rows before any training started."""


class IgnoredParamWarning(UserWarning):
    """A Horovod param that has no equivalent in sparktrain was set; it is ignored."""


class ExecutorEnvironmentError(TrainingError):
    """The executors' Python cannot run a rank: ``missing`` modules, or the wrong ``python``.

    A :class:`TrainingError`, so code catching fit failures as ``TrainingError`` keeps doing
    so."""

    def __init__(self, message: str, python: Optional[str] = None,
                 missing: Sequence[str] = (), attempts: int = 1) -> None:
        super().__init__(message, attempts=attempts)
        self.python = python
        self.missing = list(missing)


class CheckpointError(RuntimeError):
    """No checkpoint of a run can be resumed from: every one is damaged (the message names
    the files and what is wrong with each)."""


class StoreFullError(OSError):
    """A write to the store ran out of space: ``path`` (what was written), ``needed`` (its
    bytes, where known). An ``OSError`` with ``errno.ENOSPC``, so ``except OSError`` sees it."""

    def __init__(self, message: str, path: str, needed: Optional[int] = None) -> None:
        import errno

        super().__init__(errno.ENOSPC, message)
        self.path, self.needed = path, needed

    def __str__(self) -> str:
        return self.strerror or ""  # set from ``message`` by __init__


class LocalDiskFullError(OSError):
    """A rank's local disk (Spark's local directory, where streamed rows are kept) ran out of
    space: ``path`` (the folder), ``needed`` (bytes, where known). Not retried: the next
    attempt would find the same disk. An ``OSError`` with ``errno.ENOSPC``."""

    def __init__(self, message: str, path: str, needed: Optional[int] = None) -> None:
        import errno

        super().__init__(errno.ENOSPC, message)
        self.path, self.needed = path, needed

    def __str__(self) -> str:
        return self.strerror or ""  # set from ``message`` by __init__


def spark_disk_full(text: str, local_dirs: str = "spark.local.dir"
                    ) -> Optional[LocalDiskFullError]:
    """The :class:`LocalDiskFullError` for a Spark job that failed on a full local disk (its
    shuffle or block files), from the failure's ``text`` (``local_dirs``: the session's local
    directories, named where the text does not say which disk); ``None`` for any other."""
    import re

    if "No space left on device" not in text:
        return None
    found = re.search(r"(/\S+?)/(?:blockmgr|spark)-[0-9a-f-]+", text)
    disk = found.group(1) if found else local_dirs
    return LocalDiskFullError(
        f"a Spark task ran out of local disk in {disk} (Spark's local directory: "
        f"SPARK_LOCAL_DIRS / spark.local.dir, where its shuffle files go): No space left on "
        f"device. With input_mode='stream' and num_proc taking every task slot, the rows go "
        f"through a shuffle and each rank keeps its whole shard there; leave task slots free "
        f"beside the ranks (more executor cores than num_proc: the rows are then dealt to "
        f"the ranks with no shuffle and read again each epoch when they do not fit), point "
        f"SPARK_LOCAL_DIRS at a bigger disk, or use input_mode='store'. Not retried: the "
        f"next attempt would find the same disk.", disk)


class RunInUseError(RuntimeError):
    """Another fit is training with the same ``run_id`` right now."""
