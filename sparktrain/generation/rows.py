"""A Spark task's rows through a generation engine: prompts rendered and tokenized per Arrow
batch, rows that cannot be answered kept as row errors, the engine fed lazily across batches
(several batches in flight), answers decoded and put back in their batch's order.

Example (executor side; no Spark needed)::

    for out in answer_batches(iter([{"q": ["2+2?"]}]), worker): ...
    # {"text": [...], "finish_reason": [...], "prompt_tokens": [...], ...}
"""
from __future__ import annotations

import collections
import itertools
import pickle
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

from sparktrain.generation.engines import Completion, Request, load_engine, row_seed
from sparktrain.generation.prompts import PromptSpec
from sparktrain.generation.settings import GenerationSettings

#: the output struct's fields and their Spark types, in order
OUTPUT_FIELDS = (("text", "string"), ("finish_reason", "string"), ("prompt_tokens", "int"),
                 ("completion_tokens", "int"), ("error", "string"))


@dataclass(frozen=True)
class WorkerPlan:
    """All an executor needs to answer rows (picklable, a few KiB for a model in a file):
    the module's source (:meth:`TorchModel.module_source`), the pickled tokenizer, the
    prompt, the settings, the engine, the rows in flight and the GPU choice."""

    source: Tuple[Any, ...]
    tokenizer: bytes
    prompt: PromptSpec
    settings: GenerationSettings
    engine: Any = "continuous"  # engines.shipped_engine: "module:Class", or a pickled class
    window: int = 32
    use_gpu: Optional[bool] = None
    integers: Tuple[str, ...] = ()  # integer columns: pandas hands them as floats with a null
    seed_col: Optional[str] = None  # an integer column seeding each row's sampling

    def columns(self) -> List[str]:
        """The columns the UDF reads: the prompt's, then ``seed_col``."""
        names = self.prompt.columns()
        return names + [self.seed_col] if self.seed_col and self.seed_col not in names \
            else names


@dataclass
class Worker:
    """A Python worker's loaded engine and tokenizer, and the longest prompt it takes."""

    engine: Any
    tokenizer: Any
    prompt: PromptSpec
    settings: GenerationSettings
    prompt_limit: int
    seed_col: Optional[str] = None


def context_length(config: Any) -> int:
    """The most tokens the model attends to, from its config (2048 where it says nothing)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def load_worker(plan: WorkerPlan) -> Worker:
    """Build the engine for ``plan``: the module loaded (a LoRA fine-tune merged into its base
    weights: generation then runs the plain model, with no adapter matmuls per token), on the
    task's GPU where Spark gave one, in eval mode."""
    from sparktrain.estimators.torch_model import load_source, predict_device, use_task_cores
    from sparktrain.launch.gpus import task_gpu

    module = load_source(plan.source)
    if hasattr(module, "merge_and_unload"):  # peft's PeftModel
        module = module.merge_and_unload()
    if not hasattr(module, "generate") or not hasattr(module, "config"):
        raise TypeError(f"TextGenerator needs a transformers causal language model (with "
                        f"generate() and a config); the model is a {type(module).__name__}")
    module = module.to(predict_device(task_gpu(plan.use_gpu))).eval()
    use_task_cores()
    tokenizer = pickle.loads(plan.tokenizer)
    # the model's may be a list (Llama 3: end of text and end of turn)
    eos = [tokenizer.eos_token_id, getattr(module.generation_config, "eos_token_id", None)]
    eos_ids = sorted({e for item in eos for e in (item if isinstance(item, list) else [item])
                      if e is not None})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        (eos_ids[0] if eos_ids else 0)
    engine = load_engine(plan.engine)(module, plan.settings, eos_ids, pad, plan.window,
                                      tokenizer=tokenizer)
    limit = plan.settings.prompt_limit(context_length(module.config))
    return Worker(engine, tokenizer, plan.prompt, plan.settings, limit, plan.seed_col)


# One engine per Python worker and plan, kept across tasks (Python workers are reused).
_WORKERS: Dict[str, Worker] = {}


def worker_for(key: str, plan: WorkerPlan) -> Worker:
    worker = _WORKERS.get(key)
    if worker is None:
        for old in _WORKERS.values():  # one model in memory at a time
            old.engine.close()
        _WORKERS.clear()
        worker = _WORKERS[key] = load_worker(plan)
    return worker


def drop_worker(key: str) -> None:
    """Close and forget the engine kept for ``key`` (after it failed)."""
    worker = _WORKERS.pop(key, None)
    if worker is not None:
        worker.engine.close()


@dataclass
class _Batch:
    """An input batch's answers as they arrive, and how many are still missing."""

    rows: List[Optional[Dict[str, Any]]]
    missing: int = 0


def _row(text: str = "", reason: str = "error", prompt: int = 0, completion: int = 0,
         error: Optional[str] = None) -> Dict[str, Any]:
    return {"text": text, "finish_reason": reason, "prompt_tokens": prompt,
            "completion_tokens": completion, "error": error}


def _answer(worker: Worker, done: Completion, prompt_tokens: int) -> Dict[str, Any]:
    if done.error is not None:
        return _row(prompt=prompt_tokens, error=done.error)
    text = worker.tokenizer.decode(done.tokens, skip_special_tokens=True)
    text, stopped = worker.settings.cut_at_stop(text)
    reason = "stop" if done.ended or stopped else "length"
    return _row(text, reason, prompt_tokens, len(done.tokens))


def _seeds(worker: Worker, batch: Dict[str, List[Any]], encoded: List[List[int]],
           texts: List[Tuple[int, str]]) -> Dict[int, Any]:
    """With sampling, each prompt row's seed (:func:`~.engines.row_seed` of its ``seed_col``
    value, or of its prompt's tokens), or its error where that value is null."""
    settings = worker.settings
    if not settings.sampling:
        return {}
    values = batch.get(worker.seed_col) if worker.seed_col else None
    seeds: Dict[int, Any] = {}
    for (i, _), ids in zip(texts, encoded, strict=True):
        if values is None:
            seeds[i] = row_seed(settings.seed, tuple(ids))
        elif values[i] is None:
            seeds[i] = f"column {worker.seed_col!r} is null in this row"
        else:
            seeds[i] = row_seed(settings.seed, int(values[i]))
    return seeds


def answer_batches(batches: Iterator[Dict[str, List[Any]]],
                   worker: Worker) -> Iterator[Dict[str, List[Any]]]:
    """Each input batch (columns by name) answered: one output batch per input batch, in
    order, as soon as its last row is answered, while later batches' rows are already in
    the engine."""
    queue: Deque[_Batch] = collections.deque()
    keys: Dict[int, Tuple[_Batch, int, int]] = {}
    counter = itertools.count()
    limit = worker.prompt_limit

    def requests() -> Iterator[Request]:
        for batch in batches:
            rendered = worker.prompt.render(batch)
            entry = _Batch([None] * len(rendered))
            texts = [(i, text) for i, (text, _) in enumerate(rendered) if text is not None]
            encoded = worker.prompt.encode(worker.tokenizer, [t for _, t in texts]) \
                if texts else []
            ready = []
            for i, (_, error) in enumerate(rendered):
                if error is not None:
                    entry.rows[i] = _row(error=error)
            seeds = _seeds(worker, batch, encoded, texts)
            for (i, _), ids in zip(texts, encoded, strict=True):
                if not ids:
                    entry.rows[i] = _row(error="the prompt is empty")
                elif len(ids) > limit:
                    entry.rows[i] = _row(prompt=len(ids), error=(
                        f"the prompt has {len(ids)} tokens; at most {limit} fit (the model's "
                        f"context less maxNewTokens, or maxPromptTokens)"))
                elif isinstance(seeds.get(i), str):
                    entry.rows[i] = _row(prompt=len(ids), error=seeds[i])
                else:
                    key = next(counter)
                    keys[key] = (entry, i, len(ids))
                    ready.append(Request(key, ids, seeds.get(i)))
            entry.missing = len(ready)  # counted before any is sent: none can finish it early
            queue.append(entry)
            yield from ready

    def complete() -> Iterator[Dict[str, List[Any]]]:
        while queue and queue[0].missing == 0:
            rows = queue.popleft().rows
            yield {name: [row[name] for row in rows if row is not None]
                   for name, _ in OUTPUT_FIELDS}

    for done in worker.engine.generate(requests()):
        entry, i, prompt_tokens = keys.pop(done.key)
        entry.rows[i] = _answer(worker, done, prompt_tokens)
        entry.missing -= 1
        yield from complete()
    yield from complete()
    if queue:
        raise RuntimeError(f"the generation engine ended with {len(keys)} row(s) unanswered")


def generation_udf(key: str, plan: WorkerPlan) -> Any:
    """The iterator ``pandas_udf`` answering the prompt's columns (in
    ``plan.columns()`` order) as a struct of :data:`OUTPUT_FIELDS`. A pandas UDF on
    every pyspark (classic, Connect, 3.5 and 4): the model's time dwarfs pandas' here."""
    from typing import Iterator as Iter
    from typing import Tuple as Tup

    import pandas as pd
    from pyspark.sql import functions as F

    names = plan.columns()
    schema = ", ".join(f"{name} {kind}" for name, kind in OUTPUT_FIELDS)

    def answer(batches):  # type hints set below: they select the UDF's shape
        from sparktrain.estimators.prediction import one_tokenizer_thread

        one_tokenizer_thread()
        worker = worker_for(key, plan)

        def values(name: str, s: pd.Series) -> List[Any]:
            kept = s.astype(object).where(s.notna(), None).tolist()
            if name in plan.integers:  # 3, not 3.0, in a template
                return [None if v is None else int(v) for v in kept]
            return kept

        def columns() -> Iterator[Dict[str, List[Any]]]:
            for series in batches:
                series = series if isinstance(series, tuple) else (series,)
                yield {name: values(name, s) for name, s in zip(names, series, strict=True)}

        try:
            for out in answer_batches(columns(), worker):
                yield pd.DataFrame(out)
        except BaseException:  # failed, or closed early (a limit): rows may still be in flight,
            # and the next task must not get their answers
            drop_worker(key)
            raise

    answer.__annotations__ = {
        "batches": Iter[Tup[pd.Series, ...]] if len(names) > 1 else Iter[pd.Series],
        "return": Iter[pd.DataFrame]}
    return F.pandas_udf(answer, schema)  # type: ignore[call-overload]
