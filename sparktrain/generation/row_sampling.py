"""Sampling each row from a seed of its own: a row's text depends on its seed and its logits,
not on the rows decoded beside it, their order or the batch sizes.

``model.generate`` samples a whole batch from torch's one global generator, so a row's draws
depend on its neighbours. :class:`RowSampler` is a logits processor that does the sampling
itself (temperature, then the ``top_p`` nucleus, then one uniform draw per row from the row's
own ``random.Random``, inverted through the row's cumulative probabilities) and leaves only
the chosen token; ``generate`` then decodes greedily.

Example (what the static engine does with sampling)::

    sampler = RowSampler([row_seed(0, 7), row_seed(0, 8)], temperature=0.8, top_p=0.95)
    model.generate(..., do_sample=False, logits_processor=LogitsProcessorList([sampler]))
"""
from __future__ import annotations

import random
from typing import Any, List


def nucleus(scores: Any, top_p: float) -> Any:
    """``scores`` with every token outside the ``top_p`` probability mass at ``-inf`` (the
    most likely token is always kept)."""
    import torch

    ranked, order = scores.sort(dim=-1, descending=True)
    probs = ranked.softmax(dim=-1)
    beyond = probs.cumsum(dim=-1) - probs > top_p
    return scores.scatter(-1, order, ranked.masked_fill(beyond, -torch.inf))


class RowSampler:
    """A ``generate`` logits processor, last in the list: each row's next token drawn from its
    own generator, every other token left at ``-inf`` (decode greedily after it). Tokens a
    processor before it masked (a ``responseSchema``) have no probability here."""

    def __init__(self, seeds: List[int], temperature: float, top_p: float = 1.0) -> None:
        self._draws = [random.Random(seed) for seed in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        scores = scores.float() / self.temperature
        if self.top_p < 1:
            scores = nucleus(scores, self.top_p)
        return pick(scores, [rng.random() for rng in self._draws])


def pick(scores: Any, draws: List[float]) -> Any:
    """For each row, the token where its uniform draw falls in its cumulative probabilities,
    as the only token left (every other at ``-inf``)."""
    import torch

    cumulative = scores.softmax(dim=-1).cumsum(dim=-1)
    uniform = torch.tensor(draws, dtype=cumulative.dtype, device=cumulative.device)[:, None]
    # the first token whose cumulative probability reaches the draw
    chosen = (cumulative < uniform * cumulative[:, -1:]).sum(dim=-1)
    chosen = chosen.clamp(max=scores.shape[-1] - 1)
    only = torch.full_like(scores, -torch.inf)
    only[torch.arange(len(chosen), device=scores.device), chosen] = 0.0
    return only
