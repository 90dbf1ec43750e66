"""sparktrain's logits processors inside transformers' continuous batching: the JSON constraint
(one llguidance matcher per row in flight, advanced by the tokens the row has generated) and
the sampler that draws each row from its own seed.

Continuous batching builds its logits processors from the generation config
(``model._get_logits_processor``) when its manager is made; :func:`with_processors` adds these
to that list for the manager's construction only. Both are ``ContinuousBatchingLogitsProcessor``
(transformers' interface for processors that know which request each row of logits is):
before each step :meth:`~RowProcessor.prepare_tensor_args` is given the rows that will get a
new token, in the order of the logits. The manager runs without CUDA graphs or asynchronous
batching then (these processors are Python, and need each row's last token before the next
step). Tested with transformers 5.24; a transformers without this interface is refused by name
(use ``engine="static"``).

Example (what the continuous engine does with a schema and sampling)::

    grammar = GrammarProcessor(json_tokenizer(tok, vocab, eos), compile_grammar(schema))
    sampler = SeededSampler(temperature=0.8, top_p=0.95, fallback=0)
    with with_processors(model, [grammar, sampler]):
        manager = model.init_continuous_batching(...)   # with do_sample=False: greedy after
"""
from __future__ import annotations

import random
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Set

import torch

try:
    from transformers import LogitsProcessorList
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
    )
except ImportError as missing:  # pragma: no cover - depends on the executor's transformers
    raise ImportError(f"a responseSchema or sampling with engine='continuous' needs "
                      f"transformers' ContinuousBatchingLogitsProcessor (transformers 5.24 has "
                      f"it): {missing}; use engine='static'") from None

from sparktrain.generation.json_constraint import apply_mask, llguidance
from sparktrain.generation.row_sampling import nucleus, pick


class RowProcessor(ContinuousBatchingLogitsProcessor):
    """A processor that keeps something per request in flight (``_per_row``), told which
    requests the rows of the next logits are and when a request is answered."""

    supported_kwargs: Dict[str, type] = {}
    ignored_kwargs = ()

    def __init__(self) -> None:
        self._per_row: Dict[str, Any] = {}
        self._rows: List[Any] = []  # the states of the next logits' rows, in order
        self._finished: Set[str] = set()
        self._lock = threading.Lock()

    def forget(self, request_id: str) -> None:
        """The row is answered: what is kept for it goes at the next step (called from the
        engine's thread, not the manager's)."""
        with self._lock:
            self._finished.add(request_id)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token: List[Any]) -> torch.Tensor:
        with self._lock:
            for request_id in self._finished:
                self._per_row.pop(request_id, None)
            self._finished.clear()
        self._rows = [future.state for future in requests_with_new_token]
        return torch.zeros(len(self._rows), dtype=torch.int32)


class GrammarProcessor(RowProcessor):
    """Each row in flight follows ``grammar`` from its first new token. ``errors``: rows whose
    tokens left the grammar, by request id."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        super().__init__()
        self._template = llguidance().LLMatcher(tokenizer, grammar, log_level=0)
        if self._template.is_error():
            raise ValueError(f"responseSchema cannot be followed: {self._template.get_error()}")
        self.errors: Dict[str, str] = {}

    def _matcher(self, state: Any) -> Optional[Any]:
        """The row's matcher, given the tokens its row generated since the last step (None
        once it left the grammar)."""
        entry = self._per_row.setdefault(state.request_id, [self._template.deep_copy(), 0])
        matcher, consumed = entry
        new = list(state.generated_tokens[consumed:])
        entry[1] = consumed + len(new)
        if new and not matcher.is_error() and not matcher.consume_tokens(new):
            self.errors[state.request_id] = \
                f"the answer left responseSchema: {matcher.get_error()}"
        return None if matcher.is_error() else matcher

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        return apply_mask(scores, [self._matcher(state) for state in self._rows])


class SeededSampler(RowProcessor):
    """Each row's next token drawn from its own ``random.Random``, seeded by ``seeds[request
    id]`` (``fallback`` plus the id where none was given), as
    :class:`~.row_sampling.RowSampler` does in the static engine: the manager then decodes
    greedily."""

    def __init__(self, temperature: float, top_p: float, fallback: int) -> None:
        super().__init__()
        self.temperature, self.top_p, self.fallback = temperature, top_p, fallback
        self.seeds: Dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        self.seeds.pop(request_id, None)  # a row cancelled before its first token
        super().forget(request_id)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        draws = []
        for state in self._rows:
            rng = self._per_row.get(state.request_id)
            if rng is None:
                seed = self.seeds.pop(state.request_id, None)
                rng = self._per_row[state.request_id] = random.Random(
                    self.fallback + int(state.request_id) if seed is None else seed)
            draws.append(rng.random())
        scores = scores.float() / self.temperature
        if self.top_p < 1:
            scores = nucleus(scores, self.top_p)
        return pick(scores, draws)


@contextmanager
def with_processors(model: Any, processors: List[RowProcessor]) -> Iterator[None]:
    """While the block makes a continuous batching manager, ``model``'s logits processors end
    with ``processors``."""
    built = model._get_logits_processor

    def listed(*args: Any, **kwargs: Any) -> Any:
        return LogitsProcessorList([*built(*args, **kwargs), *processors])

    model._get_logits_processor = listed
    try:
        yield
    finally:
        del model._get_logits_processor
