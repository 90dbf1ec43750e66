"""The static engine: rows in padded batches through ``model.generate``, each batch running
until its longest answer ends. What a hand-written ``predict_batch_udf`` does, kept as the
baseline of ``bench/bench_generate.py``, for models continuous batching cannot run, and faster
than it where answers have even lengths (``bench/bench_structured.py``). A ``responseSchema``
and each row's seed are logits processors of each ``generate`` call (:mod:`.json_constraint`,
:mod:`.row_sampling`).

Example::

    engine = StaticEngine(model, GenerationSettings(max_new_tokens=16), [2], 0, window=16)
    list(engine.generate([Request(0, [5, 6, 7])]))
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator, List, Optional, Tuple

from sparktrain.generation.engines import Completion, GenerationEngine, Request
from sparktrain.generation.row_sampling import RowSampler


class StaticEngine(GenerationEngine):
    """Batches of ``window`` rows, left-padded, one ``generate`` call each; with sampling,
    each row drawn from its own seed (:class:`~.row_sampling.RowSampler`: no top-k, the
    ``topP`` nucleus, as the continuous engine samples)."""

    follows_schema = True
    seeds_rows = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._json: Optional[Tuple[Any, str]] = None  # llguidance's tokenizer, the grammar

    def _constraint(self, rows: int) -> Any:
        """A batch's :class:`~.json_constraint.JsonConstraint`, or None without a schema."""
        if not self.settings.json_schema:
            return None
        from sparktrain.generation import json_constraint as jc

        if self._json is None:
            self._json = jc.compiled(self.tokenizer, self.model.config.vocab_size,
                                     self.eos_ids, self.settings.json_schema)
        tokenizer, grammar = self._json
        return jc.JsonConstraint(tokenizer, grammar, rows, self.eos_ids)

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        import torch
        from transformers import LogitsProcessorList, StoppingCriteriaList

        settings = self.settings
        # greedy over the processed scores: with sampling, RowSampler has already chosen
        options = dict(max_new_tokens=settings.max_new_tokens, do_sample=False,
                       eos_token_id=self.eos_ids, pad_token_id=self.pad_id)
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
            sampler = RowSampler([settings.seed + r.key if r.seed is None else r.seed
                                  for r in batch], settings.temperature, settings.top_p) \
                if settings.sampling else None
            constraint = self._constraint(len(batch))
            processors = LogitsProcessorList([p for p in (constraint, sampler) if p])
            # a row stops decoding at its first stop string (generate's own stop_strings needs
            # a tokenizer that can encode any text: a word-level one cannot)
            stops = StoppingCriteriaList([_StopStrings(self, longest)] if settings.stop else [])
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(
                    device), logits_processor=processors, stopping_criteria=stops, **options)
            errors: List[Optional[str]] = constraint.errors if constraint else [None] * len(batch)
            for request, row, error in zip(batch, out[:, longest:].tolist(), errors, strict=True):
                yield Completion(request.key, error=error) if error else \
                    self.finish(request.key, self._unpadded(row))

    def _unpadded(self, row: List[int]) -> List[int]:
        """A row without the padding ``generate`` put after it once it stopped at a stop
        string while others went on (an end-of-sequence token is cut by ``finish``)."""
        if not self.settings.stop or self.pad_id in self.eos_ids:
            return row
        end = len(row)
        while end and row[end - 1] == self.pad_id:
            end -= 1
        return row[:end]


class _StopStrings:
    """A ``generate`` stopping criterion: the rows whose new text holds a stop string."""

    def __init__(self, engine: GenerationEngine, prompt_length: int) -> None:
        self.engine, self.prompt_length = engine, prompt_length

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        rows = input_ids[:, self.prompt_length:].tolist()
        return torch.tensor([self.engine.has_stop(row) for row in rows], dtype=torch.bool,
                            device=input_ids.device)

