"""The JSON constraint inside transformers' continuous batching: one llguidance matcher per row
in flight, advanced by the tokens the row has generated and applied to its logits at each step.

Continuous batching builds its logits processors from the generation config
(``model._get_logits_processor``) when its manager is made; :func:`with_grammar` adds this one to
that list for the manager's construction only. It is a ``ContinuousBatchingLogitsProcessor``
(transformers' interface for processors that know which request each row of logits is): before
each step :meth:`prepare_tensor_args` is given the rows that will get a new token, in the order
of the logits, so each matcher first takes the tokens its row generated since the last step.
The manager runs without CUDA graphs or asynchronous batching then (this processor is Python,
and needs each row's last token before the next step). Tested with transformers 5.24; a
transformers without this interface is refused by name (use ``engine="static"``).

Example (what the continuous engine does with a schema)::

    grammar = GrammarProcessor(json_tokenizer(tok, vocab, eos), compile_grammar(schema), 1.0)
    with with_grammar(model, grammar):
        manager = model.init_continuous_batching(...)
"""
from __future__ import annotations

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
    raise ImportError(f"a responseSchema with engine='continuous' needs transformers' "
                      f"ContinuousBatchingLogitsProcessor (transformers 5.24 has it): "
                      f"{missing}; use engine='static'") from None

from sparktrain.generation.json_constraint import apply_mask, llguidance
from sparktrain.generation.row_sampling import nucleus


class GrammarProcessor(ContinuousBatchingLogitsProcessor):
    """Each row in flight follows ``grammar`` from its first new token; ``top_p`` < 1: the
    nucleus is taken here, after the mask (the config's own comes before it and could leave a
    row no allowed token). ``errors``: rows whose tokens left the grammar, by request id."""

    supported_kwargs: Dict[str, type] = {}
    ignored_kwargs = ()

    def __init__(self, tokenizer: Any, grammar: str, top_p: float = 1.0) -> None:
        self._template = llguidance().LLMatcher(tokenizer, grammar, log_level=0)
        if self._template.is_error():
            raise ValueError(f"responseSchema cannot be followed: {self._template.get_error()}")
        self._top_p = top_p
        self._matchers: Dict[str, List[Any]] = {}  # request id -> [matcher, tokens consumed]
        self._rows: List[Optional[Any]] = []
        self._finished: Set[str] = set()
        self._lock = threading.Lock()
        self.errors: Dict[str, str] = {}

    def forget(self, request_id: str) -> None:
        """The row is answered: its matcher goes at the next step (called from the engine's
        thread, not the manager's)."""
        with self._lock:
            self._finished.add(request_id)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token: List[Any]) -> torch.Tensor:
        with self._lock:
            for request_id in self._finished:
                self._matchers.pop(request_id, None)
            self._finished.clear()
        rows: List[Optional[Any]] = []
        for future in requests_with_new_token:
            state = future.state
            entry = self._matchers.setdefault(state.request_id,
                                              [self._template.deep_copy(), 0])
            matcher, consumed = entry
            new = list(state.generated_tokens[consumed:])
            entry[1] = consumed + len(new)
            if new and not matcher.is_error() and not matcher.consume_tokens(new):
                self.errors[state.request_id] = \
                    f"the answer left responseSchema: {matcher.get_error()}"
            rows.append(None if matcher.is_error() else matcher)
        self._rows = rows
        return torch.zeros(len(rows), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        scores = apply_mask(scores, self._rows)
        return nucleus(scores, self._top_p) if self._top_p < 1 else scores


@contextmanager
def with_grammar(model: Any, grammar: GrammarProcessor) -> Iterator[None]:
    """While the block makes a continuous batching manager, ``model``'s logits processors
    end with ``grammar``."""
    built = model._get_logits_processor

    def processors(*args: Any, **kwargs: Any) -> Any:
        return LogitsProcessorList([*built(*args, **kwargs), grammar])

    model._get_logits_processor = processors
    try:
        yield
    finally:
        del model._get_logits_processor

