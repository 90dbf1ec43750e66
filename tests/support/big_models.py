"""A model shaped like a pretrained one, for the big-model tests (issue #28): a large frozen
embedding table beside a small trained head. Imported by ``test_big_models.py`` and by
``connect_client.py`` (pickled by value with the model, as a user's module is)."""
from __future__ import annotations

import torch

from sparktrain.loop.callbacks import Callback


class FrozenTable(torch.nn.Module):
    """``rows`` x 64 float32 frozen table (``rows * 256`` bytes) and a ``Linear(68, 1)`` head
    over the 4 features and the row the first feature picks."""

    def __init__(self, rows: int = 1024) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(rows, 64)
        self.table.weight.requires_grad_(False)
        self.head = torch.nn.Linear(4 + 64, 1)

    def forward(self, x):
        ids = (x[:, 0].abs() * 1000).long() % self.table.num_embeddings
        return self.head(torch.cat([x, self.table(ids)], dim=1))


class DirtyWeightPages(Callback):
    """A callback: at the end of training each rank writes into ``directory`` how many KiB of
    its memory-mapped weights file it has written (``Private_Dirty`` in ``/proc/self/smaps``):
    pages of a ``torch.load(mmap=True)`` mapping stay shared with the page cache until written."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, model) -> None:
        import os

        dirty, in_weights = 0, False
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                    in_weights = len(head) >= 6 and "/weights-" in head[-1]
                elif in_weights and head[0] == "Private_Dirty:":
                    dirty += int(head[1])
        with open(os.path.join(self.directory, str(os.getpid())), "w") as out:
            out.write(str(dirty))
