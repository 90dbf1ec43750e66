"""A model shaped like a pretrained one, for the big-model tests (issue #28): a large frozen
embedding table beside a small trained head. Imported by ``test_big_models.py`` and by
``connect_client.py`` (pickled by value with the model, as a user's module is)."""
from __future__ import annotations

import torch


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
