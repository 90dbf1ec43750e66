"""Generation engines: what turns token ids into answers on an executor, as registered
plug-ins (like the training engines).

Built in: ``"continuous"`` (transformers' continuous batching: a row joins the running batch as
soon as another finishes, so no row waits for the longest answer of its batch) and ``"static"``
(padded batches through ``model.generate``: what a hand-written UDF does; the baseline of
``bench/bench_generate.py``). An engine is built once per Python worker and kept across tasks.

Example::

    register_generation_engine("vllm", "my_pkg.vllm_engine:VllmEngine")
    TextGenerator(..., engine="vllm")
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional

from sparktrain.generation.settings import GenerationSettings
from sparktrain.pickling import dumps
from sparktrain.plugins import check_entry, load


@dataclass(frozen=True)
class Request:
    """One row to answer: ``key`` (the caller's), the prompt's token ids, and with sampling
    the row's own ``seed`` (:func:`row_seed`)."""

    key: int
    input_ids: List[int]
    seed: Optional[int] = None


def row_seed(seed: int, identity: Any) -> int:
    """A row's sampling seed from the transform's ``seed`` and what identifies the row (its
    ``seedCol`` value, or its prompt's token ids): the same in every process and rerun.

    >>> row_seed(0, 7) == row_seed(0, 7) != row_seed(1, 7)
    True
    """
    digest = hashlib.blake2b(repr((seed, identity)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Completion:
    """A row's answer: the new token ids (without the end-of-sequence token), whether an
    end-of-sequence token ended it, or the engine's ``error`` for this row alone."""

    key: int
    tokens: List[int] = field(default_factory=list)
    ended: bool = False
    error: Optional[str] = None


class GenerationEngine:
    """The engine interface. ``model``: a transformers causal LM, on its device, in eval mode;
    ``eos_ids``: the token ids that end an answer; ``window``: how many rows may be in flight;
    ``tokenizer``: the model's (a Hugging Face tokenizer).

    :meth:`generate` pulls requests lazily (at most ``window`` unanswered at once) and yields
    each completion as soon as it is done, in any order; a row the engine rejects comes back
    with ``error`` set, and the others go on. An engine that sets ``follows_schema`` decodes
    ``settings.json_schema`` (where set) into JSON valid for it; one that sets ``seeds_rows``
    samples each row from its request's ``seed`` alone, whatever rows are decoded beside it.
    ``TextGenerator`` gives a ``responseSchema`` or a ``seedCol`` only to such engines.
    """

    follows_schema = False
    seeds_rows = False

    def __init__(self, model: Any, settings: GenerationSettings, eos_ids: List[int],
                 pad_id: int, window: int, tokenizer: Any = None) -> None:
        self.model, self.settings, self.tokenizer = model, settings, tokenizer
        self.eos_ids, self.pad_id, self.window = list(eos_ids), pad_id, window

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the engine holds (threads, caches); the worker may build another."""

    def has_stop(self, tokens: List[int]) -> bool:
        """Whether the text of generated ``tokens`` holds one of ``settings.stop``."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return self.settings.cut_at_stop(text)[1]

    def finish(self, key: int, tokens: List[int]) -> Completion:
        """A completion from generated ``tokens``: cut at the first end-of-sequence token and
        at ``max_new_tokens``."""
        tokens = list(tokens)[:self.settings.max_new_tokens]
        for i, token in enumerate(tokens):
            if token in self.eos_ids:
                return Completion(key, tokens[:i], ended=True)
        return Completion(key, tokens)


ENGINES: Dict[str, Any] = {
    "continuous": "sparktrain.generation.hf_continuous:ContinuousEngine",
    "static": "sparktrain.generation.hf_static:StaticEngine",
}


def register_generation_engine(name: str, entry: Any) -> None:
    """Add (or replace) a generation engine: a :class:`GenerationEngine` subclass or its
    ``"module:Class"`` string, imported when first used."""
    check_entry("generation engine", name, entry, GenerationEngine)
    ENGINES[name] = entry


def check_engine(name: str) -> None:
    """``ValueError`` naming the registered engines where ``name`` is none of them."""
    if name not in ENGINES:
        raise ValueError(f"engine {name!r} is not a registered generation engine; registered: "
                         f"{sorted(ENGINES)} (add one with register_generation_engine)")


def engine_class(name: str) -> Any:
    """The engine class registered as ``name`` (in this process)."""
    check_engine(name)
    return load(ENGINES[name])


def shipped_engine(name: str) -> Any:
    """What executors load the engine ``name`` from: its ``"module:Class"`` string, or a
    class registered here pickled with its module by value (executors run other processes,
    where the registration never ran and the user's module may not be importable)."""
    check_engine(name)
    entry = ENGINES[name]
    return entry if isinstance(entry, str) else dumps(entry)


def load_engine(shipped: Any) -> Any:
    """The engine class from :func:`shipped_engine`'s value (or a name registered here)."""
    if isinstance(shipped, bytes):
        return pickle.loads(shipped)
    return engine_class(shipped) if shipped in ENGINES else load(shipped)
