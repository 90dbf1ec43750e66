"""Decoding that follows a JSON schema: at every step each row may only pick a token that keeps
its answer a prefix of a JSON document valid for the schema, and once the document is complete
only an end-of-sequence token. Every answer that ends (``finish_reason="stop"``) parses.

The grammar engine is llguidance (``pip install llguidance``, in sparktrain's ``hf`` extra): a
Rust library with no Python dependencies (xgrammar 0.2.8 requires torch, transformers and
triton), a JSON schema compiled in about a millisecond (outlines-core first indexes its regular
expression over the whole vocabulary), a token mask in microseconds on the CPU, and the one
vLLM, SGLang and llama.cpp also use (docs/generation.md has the figures). JSON is written
compact (no whitespace between tokens): a small model cannot wander in whitespace.

Example (what the static engine does for one batch)::

    constraint = JsonConstraint(json_tokenizer(tokenizer, vocab, eos_ids), grammar, rows=8)
    model.generate(..., logits_processor=LogitsProcessorList([constraint]))
    constraint.errors   # a row whose tokens left the grammar (None where none did)
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

#: llguidance's JSON options: compact JSON, no whitespace between tokens
JSON_OPTIONS = {"whitespace_flexible": False}


def llguidance() -> Any:
    """The llguidance module; ``ImportError`` saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise ImportError("responseSchema needs llguidance on the driver and the executors: "
                          "pip install 'sparktrain[hf]' (or llguidance)") from None
    return llguidance


def compile_grammar(json_schema: str) -> str:
    """llguidance's grammar for ``json_schema``; ``ValueError`` naming responseSchema where it
    cannot be followed (no tokenizer needed: checked on the driver before any job)."""
    matcher = llguidance().LLMatcher
    try:
        grammar = matcher.grammar_from_json_schema(json_schema, defaults=JSON_OPTIONS)
    except ValueError as error:
        raise ValueError(f"responseSchema is not a JSON schema: {error}") from None
    failed, messages = matcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise ValueError(f"responseSchema cannot be followed: {messages[0]}")
    return str(grammar)


def json_tokenizer(tokenizer: Any, vocab: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer, for logits ``vocab`` wide (about a
    second for a large vocabulary: build it once per engine)."""
    llguidance()
    from llguidance.hf import from_tokenizer

    try:
        return from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos_ids))
    except ValueError as error:
        raise ValueError(f"responseSchema needs a fast tokenizer (PreTrainedTokenizerFast): "
                         f"{error}") from None


def compiled(tokenizer: Any, vocab: int, eos_ids: Sequence[int],
             json_schema: str) -> Tuple[Any, str]:
    """``(llguidance's tokenizer, the grammar)`` an engine builds once for ``json_schema``."""
    return json_tokenizer(tokenizer, vocab, eos_ids), compile_grammar(json_schema)


class JsonConstraint:
    """A ``model.generate`` logits processor for one batch of ``rows``: each row follows
    ``grammar`` from its first new token (sampling, where asked, comes after it:
    :class:`~.row_sampling.RowSampler`, so its nucleus is taken among allowed tokens)."""

    def __init__(self, tokenizer: Any, grammar: str, rows: int,
                 eos_ids: Sequence[int]) -> None:
        template = llguidance().LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"responseSchema cannot be followed: {template.get_error()}")
        self._matchers = [template.deep_copy() for _ in range(rows)]
        self._eos = set(eos_ids)
        self._done = [False] * rows
        self._started = False
        self.errors: List[Optional[str]] = [None] * rows

    def _advance(self, last: List[int]) -> None:
        """Each row's matcher takes the token generate chose for it at the last step."""
        for i, token in enumerate(last):
            if self._done[i]:
                continue
            if token in self._eos:
                self._done[i] = True
            elif not self._matchers[i].consume_token(token):
                self.errors[i] = f"the answer left responseSchema: " \
                                 f"{self._matchers[i].get_error()}"
                self._done[i] = True

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self._started:
            self._advance(input_ids[:, -1].tolist())
        self._started = True
        # a finished row gets padding whatever its scores
        return apply_mask(scores, [None if done else matcher
                                   for matcher, done in zip(self._matchers, self._done,
                                                            strict=True)])


def apply_mask(scores: Any, matchers: List[Optional[Any]]) -> Any:
    """``scores`` (a row per matcher) with every token its row's matcher does not allow at
    ``-inf``; a row whose matcher is None keeps every token."""
    import numpy as np
    import torch

    rows, vocab = scores.shape
    words = (vocab + 31) // 32
    mask = torch.full((rows, words), -1, dtype=torch.int32)  # -1: every token allowed
    for i, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.unsafe_compute_mask_ptr(mask[i].data_ptr(), words * 4)
    # token 32k+j is bit j of word k: little-endian bytes, their bits least first
    bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :vocab].view(bool)).to(scores.device)
    return scores.masked_fill(~allowed, -torch.inf)
