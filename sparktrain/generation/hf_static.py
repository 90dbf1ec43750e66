"""The static engine: rows in padded batches through ``model.generate``, each batch running
until its longest answer ends. What a hand-written ``predict_batch_udf`` does, kept as the
baseline of ``bench/bench_generate.py`` and for models continuous batching cannot run.

Example::

    engine = StaticEngine(model, GenerationSettings(max_new_tokens=16), [2], 0, window=16)
    list(engine.generate([Request(0, [5, 6, 7])]))
"""
from __future__ import annotations

import itertools
from typing import Iterable, Iterator

from sparktrain.generation.engines import Completion, GenerationEngine, Request


class StaticEngine(GenerationEngine):
    """Batches of ``window`` rows, left-padded, one ``generate`` call each."""

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        import torch

        settings = self.settings
        options = dict(max_new_tokens=settings.max_new_tokens, do_sample=settings.sampling,
                       eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
        if settings.sampling:
            # no top-k (generate's default keeps 50 tokens): the nucleus alone, as continuous
            options.update(temperature=settings.temperature, top_p=settings.top_p, top_k=0)
        device = next(self.model.parameters()).device
        pending = iter(requests)
        while True:
            batch = list(itertools.islice(pending, self.window))
            if not batch:
                return
            longest = max(len(r.input_ids) for r in batch)
            ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, request in enumerate(batch):
                ids[i, longest - len(request.input_ids):] = torch.tensor(request.input_ids)
                mask[i, longest - len(request.input_ids):] = 1
            if settings.sampling:
                torch.manual_seed(settings.seed + batch[0].key)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids.to(device),
                                          attention_mask=mask.to(device), **options)
            for request, row in zip(batch, out[:, longest:].tolist(), strict=True):
                yield self.finish(request.key, row)
