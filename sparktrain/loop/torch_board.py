"""Rank 0's TensorBoard event files of a torch fit, written by torch's ``SummaryWriter``.

Example::

    board = TorchBoard(run_path, storage_options)
    board.write(epoch=0, logs={"loss": 0.3, "val_loss": 0.4})
    board.close()
"""
from __future__ import annotations

from typing import Any

from sparktrain.loop.epochs import EpochBoard


class TorchBoard(EpochBoard):
    """:class:`~sparktrain.loop.epochs.EpochBoard` written by torch's ``SummaryWriter``."""

    def _open(self, directory: str) -> Any:
        import sys
        import types

        # tensorboard.compat imports all of TensorFlow when it is installed (8 s here) unless
        # the module tensorboard.compat.notf exists: its own switch to the TF-free stub.
        stub = "tensorboard.compat.notf"
        sys.modules.setdefault(stub, types.ModuleType(stub))
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(directory)

    def _scalar(self, writer: Any, tag: str, value: float, step: int) -> None:
        writer.add_scalar(tag, value, step)
