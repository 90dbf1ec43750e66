#!/usr/bin/env python
"""Benchmark Hugging Face fine-tuning from a Spark DataFrame: sparktrain's TorchEstimator
against the path Databricks documents (``datasets.Dataset.from_spark`` + ``transformers.Trainer``
inside ``TorchDistributor``), and a plain in-memory loop as the per-rank speed reference.

    .venv/bin/python bench/bench_hf.py                  # 20,000 rows, 2 epochs, every contender
    .venv/bin/python bench/bench_hf.py --quick          # smoke run (4,000 rows, 1 epoch, 1 repeat)
    .venv/bin/python bench/bench_hf.py --skip sparktrain

Every contender gets the same data (synthetic sentiment sentences, generated with --seed), the
same tokenizer (WordPiece trained in memory, padded/truncated to --max-length), the same tiny
BERT (built from a BertConfig, seeded), AdamW with the same learning rate and linear
warm-up/decay, --batch-size rows per rank per step, --epochs, 2 processes.

Figures (bench/README.md: method and figures; bench/HISTORY.md, "bench_hf.py": the full write-up):

  e2e       wall s from the training DataFrame to a trained model: TorchEstimator.fit vs
            Dataset.from_spark + .map(tokenize) + TorchDistributor(local_mode=True).run(Trainer)
            (ratio = baseline s / sparktrain s: the speed-up)
  accuracy  held-out accuracy of the two trained models (sparktrain's from transform's
            label__output; the Trainer model's predicted in the driver)
  steps/s   one rank's steady-state optimizer steps/s in sparktrain's fit vs the same model's
            steps/s in a single-process loop over pre-tokenized in-memory tensors
            (extra: Trainer's steps/s per rank)

Prints progress to stderr, then a table and one JSON line per figure to stdout, and writes
everything to --json-out (default bench/results/bench_hf.json). Needs the `hf` and `bench`
extras (transformers, tokenizers; datasets for the baseline).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from bench_backends import RankLog
from common import (
    add_common_args,
    arg_meta,
    cached,
    figure,
    guarded,
    hang_extras,
    load_meta,
    load_note,
    local_session,
    new_parser,
    parse_common,
    progress,
    report,
    sparktrain_logs,
    versions,
)

FIGURES = ("sparktrain", "trainer", "reference")
CONTENDERS = FIGURES
NUM_PROC = 2
WARMUP_ROWS = 1024  # each distributed contender's untimed warm-up run (1 epoch)

# The model: a 2-layer BERT small enough for 2 CPU cores (~0.2M parameters with the vocab below).
BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=64, num_labels=2)
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] = id 0, BERT's pad id

# -- data: short sentiment sentences from word lists ---------------------------------------------
POSITIVE = ("good great excellent wonderful lovely superb pleasant brilliant happy delightful "
            "fantastic enjoyable charming terrific marvelous splendid amazing perfect nice "
            "beautiful fun friendly helpful impressive solid stunning cheerful tasty clean "
            "comfortable").split()
NEGATIVE = ("bad awful terrible horrible poor dreadful boring ugly sad nasty dull annoying lousy "
            "mediocre disappointing unpleasant miserable weak broken rude noisy dirty bland slow "
            "messy painful clumsy gloomy stale cold").split()
NEUTRAL = ("the a this that our my their movie film food service room book story plot music "
           "staff place hotel show game phone car trip day evening menu screen ending actor "
           "waiter price view city garden train flight was is it and but really quite very "
           "overall experience seemed felt looked with for of in on at we they i you after "
           "before during then also still just rather somewhat mostly again today yesterday "
           "week visit table window seat chair door kitchen").split()
# (positive, negative) word counts of a sentence, by label: the majority decides the label
NEGATED = 0.05  # share of sentiment words written as "not <opposite word>"
PAIRS = {1: [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1), (3, 2)],
         0: [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]}


def make_sentences(rows: int, seed: int) -> Tuple[List[str], np.ndarray]:
    """``rows`` sentences of 6-14 neutral words with 1-5 sentiment words mixed in, a quarter of
    them negated ("not good" counts as negative); label 1 when positive ones outnumber negative
    ones (balanced labels). Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, rows)
    texts = []
    for label in labels:
        n_pos, n_neg = PAIRS[int(label)][rng.integers(len(PAIRS[int(label)]))]
        words = list(rng.choice(NEUTRAL, rng.integers(6, 15)))
        for pool, opposite, count in ((POSITIVE, NEGATIVE, n_pos), (NEGATIVE, POSITIVE, n_neg)):
            for _ in range(count):
                negated = rng.random() < NEGATED
                phrase = f"not {rng.choice(opposite)}" if negated else str(rng.choice(pool))
                words.insert(int(rng.integers(len(words) + 1)), phrase)
        texts.append(" ".join(words))
    return texts, labels.astype(np.int32)


def make_frames(spark, rows: int, test_rows: int, seed: int):
    """The training and held-out DataFrames (``text`` string, ``label`` int; 2 partitions
    each), cached and counted, and the training texts (to train the tokenizer on)."""
    import pandas as pd

    texts, labels = make_sentences(rows + test_rows, seed)
    frames = []
    for lo, hi in ((0, rows), (rows, rows + test_rows)):
        pdf = pd.DataFrame({"text": texts[lo:hi], "label": labels[lo:hi]})
        frames.append(cached(spark.createDataFrame(pdf, "text string, label int")
                             .repartition(NUM_PROC)))
    return frames[0], frames[1], texts[:rows], texts[rows:], labels[:rows], labels[rows:]


# -- tokenizer, tokenization, model: the same for every contender ---------------------------------
def train_tokenizer(texts: List[str], vocab_size: int, max_length: int):
    """A WordPiece tokenizer trained in memory on ``texts`` (no download), wrapped as a
    ``transformers.PreTrainedTokenizerFast`` that adds ``[CLS] ... [SEP]``.

    The trainer numbers its tokens differently from process to process (ties between merges
    are broken in hash-map order), which would change the token ids, hence which embedding row
    each word starts from, and the accuracies, from run to run. So its tokens are renumbered in
    a fixed order (special tokens, the corpus' words, the other word pieces, each sorted) and
    padded with unused tokens to exactly ``vocab_size``: every word of these sentences is then
    one token with the same id in every run."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def shell(model):
        tok = Tokenizer(model)
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return tok

    trained = shell(models.WordPiece(unk_token="[UNK]"))
    # show_progress=False: the trainer's progress bars leave blank lines on stdout
    trained.train_from_iterator(texts, trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False))
    pieces = set(trained.get_vocab())
    words = {w for text in texts for w in text.lower().split()}
    if not words <= pieces:
        raise ValueError(f"--vocab-size {vocab_size} leaves {len(words - pieces)} words of the "
                         f"corpus in pieces; give at least {len(pieces) + len(words - pieces)}")
    order = SPECIAL_TOKENS + sorted(words) + sorted(pieces - words - set(SPECIAL_TOKENS))
    order += [f"[unused{i}]" for i in range(vocab_size - len(order))]
    tok = shell(models.WordPiece(vocab={t: i for i, t in enumerate(order)}, unk_token="[UNK]"))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, order.index(t)) for t in ("[CLS]",
                                                                               "[SEP]")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=max_length)


class Tokenize:
    """The tokenization every contender runs: a batch ``{"text": strings, "label": ints}`` (a
    dict of numpy arrays in sparktrain's transformation_fn, of lists in ``datasets.map``) to
    ``input_ids`` and ``attention_mask`` (int64, ``(rows, max_length)``), and ``label`` passed
    through when the batch has one."""

    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __call__(self, batch: Dict[str, Any]) -> Dict[str, np.ndarray]:
        enc = self.tokenizer([str(t) for t in batch["text"]], padding="max_length",
                             truncation=True, max_length=self.max_length,
                             return_attention_mask=True, return_token_type_ids=False,
                             return_tensors="np")
        out = {"input_ids": enc["input_ids"].astype(np.int64),
               "attention_mask": enc["attention_mask"].astype(np.int64)}
        if "label" in batch:  # not at predict time: transform reads only what it needs
            out["label"] = np.asarray(batch["label"])
        return out


def make_model(vocab_size: int, seed: int):
    """The tiny BERT classifier, from a config (never from the hub), same weights for a seed."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(vocab_size=vocab_size, **BERT))


class LinearSchedule:
    """Linear warm-up over ``warmup`` steps, then linear decay to 0 at ``total`` steps (the
    factor ``transformers.get_linear_schedule_with_warmup`` uses, i.e. Trainer's
    ``lr_scheduler_type="linear"``). Called with an optimizer, returns its ``LambdaLR``."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))

    def __call__(self, optimizer):
        import torch

        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)


def evaluate(model, input_ids, attention_mask, labels, batch: int = 512) -> float:
    """Held-out accuracy of ``model`` on pre-tokenized tensors, in this process."""
    import torch

    model.eval()
    correct = 0
    with torch.inference_mode():
        for lo in range(0, len(labels), batch):
            logits = model(input_ids=input_ids[lo:lo + batch],
                           attention_mask=attention_mask[lo:lo + batch]).logits
            correct += int((logits.argmax(-1) == labels[lo:lo + batch]).sum())
    return correct / len(labels)


def schedule(rows: int, batch_size: int, epochs: int, warmup_ratio: float) -> Dict[str, int]:
    """Steps per rank per epoch (both distributed contenders: ceil(ceil(rows / 2) / batch)),
    total optimizer steps and warm-up steps."""
    per_epoch = max(1, math.ceil(math.ceil(rows / NUM_PROC) / batch_size))
    total = per_epoch * epochs
    return {"per_epoch": per_epoch, "total": total,
            "warmup": max(1, round(warmup_ratio * total))}


# -- contender 3: the per-rank speed reference ----------------------------------------------------
def run_reference(args, vocab_size: int, train: Dict[str, Any], test: Optional[Dict[str, Any]],
                  steps: Dict[str, int], barrier: Any = None) -> Dict[str, Any]:
    """One process, one thread (what a rank gets: torchrun and sparktrain both run 1 thread per
    rank here), the model trained for exactly one rank's steps (``steps["total"]``) on random
    batches of pre-tokenized in-memory tensors. Steps/s leaves out the first 10 steps. With a
    ``barrier``, waits on it before the first step (copies running side by side start
    together)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(vocab_size, args.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        scheduler = LinearSchedule(steps["warmup"], steps["total"])(optimizer)
        generator = torch.Generator().manual_seed(args.seed)
        n, batch, skip = len(train["label"]), args.batch_size, 10
        order = torch.randperm(n, generator=generator)
        model.train()
        position, started, losses = 0, None, []
        if barrier is not None:
            barrier.wait()
        cpu_started = None
        for step in range(steps["total"]):
            if step == skip:
                started, cpu_started = time.perf_counter(), time.process_time()
            if position + batch > n:
                order, position = torch.randperm(n, generator=generator), 0
            idx = order[position:position + batch]
            position += batch
            out = model(input_ids=train["input_ids"][idx],
                        attention_mask=train["attention_mask"][idx], labels=train["label"][idx])
            out.loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
        seconds = time.perf_counter() - started
        cpu_seconds = time.process_time() - cpu_started
    finally:
        torch.set_num_threads(threads)
    timed_steps = steps["total"] - skip
    return {"steps_per_s": timed_steps / seconds, "seconds": seconds,
            "cpu_ms_per_step": cpu_seconds / timed_steps * 1e3, "steps": steps["total"],
            "final_loss": statistics.mean(losses[-20:]),
            "accuracy": None if test is None else evaluate(
                model, test["input_ids"], test["attention_mask"], test["label"])}


def _reference_copy(args, vocab_size, train, steps, barrier, results) -> None:
    results.put(run_reference(args, vocab_size, train, None, steps, barrier))


def run_reference_pair(args, vocab_size: int, train: Dict[str, Any],
                       steps: Dict[str, int]) -> List[Dict[str, Any]]:
    """The reference loop in 2 fresh processes at once (spawned: no fork of this JVM-linked
    process): what 2 cores give each of 2 ranks before any communication or data loading."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(NUM_PROC), ctx.Queue()
    plain = argparse.Namespace(seed=args.seed, lr=args.lr, batch_size=args.batch_size)
    procs = [ctx.Process(target=_reference_copy,
                         args=(plain, vocab_size, train, steps, barrier, results))
             for _ in range(NUM_PROC)]
    for proc in procs:
        proc.start()
    out = [results.get(timeout=args.fit_timeout) for _ in procs]
    for proc in procs:
        proc.join()
    return out


# -- contender 2: Dataset.from_spark + Trainer in TorchDistributor --------------------------------
def trainer_fn(dataset, vocab_size: int, settings: Dict[str, Any], result_path: str):
    """Runs in every torchrun process TorchDistributor starts: Trainer on the tokenized
    ``datasets.Dataset``. Rank 0 saves the trained weights and its statistics to
    ``result_path``: TorchDistributor's return value cannot be used for that (in local mode every
    rank pickles its return value to the same file, and the last rank to finish wins)."""
    import time

    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    entered = time.time()
    model = make_model(vocab_size, settings["seed"])
    targs = TrainingArguments(
        output_dir=settings["output_dir"], per_device_train_batch_size=settings["batch_size"],
        num_train_epochs=settings["epochs"], learning_rate=settings["lr"],
        lr_scheduler_type="linear", warmup_steps=settings["warmup"], optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=0.0, eval_strategy="no", save_strategy="no",
        logging_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        use_cpu=True, seed=settings["seed"], ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=targs, train_dataset=dataset)
    cpu = time.process_time()
    output = trainer.train()
    cpu = time.process_time() - cpu
    info = {"rank": targs.process_index, "world_size": targs.world_size,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "threads": torch.get_num_threads(), "global_step": trainer.state.global_step,
            "train_runtime": output.metrics["train_runtime"],
            "train_steps_per_second": output.metrics["train_steps_per_second"],
            "cpu_ms_per_step": cpu / max(1, trainer.state.global_step) * 1e3,
            "train_loss": output.training_loss, "entered": entered, "trained": time.time()}
    if targs.process_index == 0:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        torch.save({"state_dict": state, "info": info}, result_path)
    return info


def run_trainer(args, spark, train_df, vocab_size: int, tokenize: Tokenize,
                steps: Dict[str, int], workdir: str, epochs: int) -> Dict[str, Any]:
    """DataFrame -> trained model the documented way; every phase timed."""
    import torch
    from datasets import Dataset
    from pyspark.ml.torch.distributor import TorchDistributor

    os.makedirs(workdir)
    started = time.perf_counter()
    dataset = Dataset.from_spark(train_df, cache_dir=os.path.join(workdir, "hf-cache"))
    converted = time.perf_counter()
    tokenized = dataset.map(tokenize, batched=True, remove_columns=["text"])
    mapped = time.perf_counter()
    settings = {"seed": args.seed, "batch_size": args.batch_size, "epochs": epochs,
                "lr": args.lr, "warmup": steps["warmup"],
                "output_dir": os.path.join(workdir, "trainer-out")}
    result_path = os.path.join(workdir, "rank0.pt")
    distributor = TorchDistributor(num_processes=NUM_PROC, local_mode=True, use_gpu=False)
    # TorchDistributor copies the torchrun output to sys.stdout: keep stdout for the results
    with contextlib.redirect_stdout(sys.stderr):
        returned = distributor.run(trainer_fn, tokenized, vocab_size, settings, result_path)
    ran = time.perf_counter()
    saved = torch.load(result_path, weights_only=False)
    model = make_model(vocab_size, args.seed)
    model.load_state_dict(saved["state_dict"])
    done = time.perf_counter()
    return {"model": model, "seconds": done - started, "from_spark_s": converted - started,
            "map_s": mapped - converted, "distributor_s": ran - mapped, "load_s": done - ran,
            "rank0": saved["info"], "returned_rank": (returned or {}).get("rank"),
            "rows": len(tokenized)}


# -- contender 1: sparktrain ---------------------------------------------------------------------
class RankClock:
    """A sparktrain callback (run on every rank): the rank's own wall clock and the CPU time of
    its process at the start of training and at each epoch's end, written to
    ``<directory>/rank-<rank>.json`` when training ends. The tokenization is not in that CPU
    time: it runs in the rank's decode worker processes."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.marks: List[Tuple[float, float]] = []

    def on_train_begin(self, model: Any, history: Dict[str, List[float]]) -> None:
        self.marks = [(time.time(), time.process_time())]

    def on_epoch_end(self, epoch: int, logs: Dict[str, float]) -> None:
        self.marks.append((time.time(), time.process_time()))

    def on_train_end(self, model: Any) -> None:
        import json

        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"rank-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "marks": self.marks}, f)


def read_rank_clocks(directory: str, per_epoch: int) -> Dict[str, Any]:
    """Per rank: epoch seconds (its own clock) and CPU ms per step of its process."""
    import glob
    import json

    ranks = []
    for path in sorted(glob.glob(os.path.join(directory, "rank-*.json"))):
        with open(path) as f:
            marks = json.load(f)["marks"]
        walls = [b[0] - a[0] for a, b in zip(marks, marks[1:], strict=False)]
        cpus = [b[1] - a[1] for a, b in zip(marks, marks[1:], strict=False)]
        ranks.append({"epoch_s": walls,
                      "cpu_ms_per_step": [c / per_epoch * 1e3 for c in cpus]})
    return {"ranks": ranks}


def make_estimator(args, vocab_size: int, tokenize: Tokenize, steps: Dict[str, int],
                   store: str, epochs: int, clock_dir: str):
    """TorchEstimator for the same job, tokenizing in ``--reader-pool`` (``"process"``: decode
    worker processes). The keyword is ``reader_pool_type`` today; ``reader_pool`` is used
    instead where the estimator takes that."""
    import inspect

    import torch

    from sparktrain import TorchEstimator

    model = make_model(vocab_size, args.seed)
    keywords = inspect.signature(TorchEstimator.__init__).parameters
    pool = "reader_pool" if "reader_pool" in keywords else "reader_pool_type"
    return TorchEstimator(
        num_proc=NUM_PROC, store=store, model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0),
        loss=None, transformation_fn=tokenize, feature_cols=["input_ids", "attention_mask"],
        label_cols=["label"], batch_size=args.batch_size, epochs=epochs,
        lr_scheduler=LinearSchedule(steps["warmup"], steps["total"]), shuffle=True,
        random_seed=args.seed, verbose=1, callbacks=[RankClock(clock_dir)],
        **{pool: args.reader_pool})


def sparktrain_missing() -> Optional[str]:
    """Why sparktrain cannot run this job yet (None when it can): the keywords it needs."""
    import inspect

    from sparktrain import TorchEstimator

    keywords = inspect.signature(TorchEstimator.__init__).parameters
    missing = [k for k in ("lr_scheduler",) if k not in keywords]
    return (f"TorchEstimator has no {', '.join(missing)} keyword yet (keyword forward, "
            f"loss=None and lr_scheduler are being added on main)") if missing else None


class _FitLog(logging.Handler):
    """Catches sparktrain's 'fit done in N s (materialize M s...)' line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.materialize_s: List[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("fit done in ") and len(record.args) >= 2:
            self.materialize_s.append(float(record.args[1]))


def run_sparktrain(args, spark, train_df, test_df, vocab_size: int, tokenize: Tokenize,
                   steps: Dict[str, int], store: str, epochs: int, state: Dict[str, Any],
                   label: str, evaluate_model: bool) -> Dict[str, Any]:
    rank_log: RankLog = state["rank_log"]
    fit_log: _FitLog = state["fit_log"]
    clock_dir = store.rstrip("/") + "-clocks"
    estimator = make_estimator(args, vocab_size, tokenize, steps, store, epochs, clock_dir)
    rank_log.take()
    seconds, model = guarded(spark, lambda: estimator.fit(train_df), args.fit_timeout, label,
                             state["hangs"])
    lines = rank_log.take()
    logged_steps = RankLog.steps(lines)
    if logged_steps is not None and logged_steps != steps["per_epoch"]:
        raise AssertionError(f"{label}: rank 0 ran {logged_steps} steps/epoch, expected "
                             f"{steps['per_epoch']}")
    epoch_s = rank0_epoch_seconds(lines)
    out = {"seconds": seconds, "epoch_gaps_s": RankLog.epoch_durations(lines),
           "epoch_s": epoch_s, "history": model.getHistory(),
           **read_rank_clocks(clock_dir, steps["per_epoch"]),
           "materialize_s": fit_log.materialize_s[-1] if fit_log.materialize_s else None}
    if evaluate_model:
        out["model"] = model
    return out


def rank0_epoch_seconds(lines: List[Tuple[float, str]]) -> List[float]:
    """The '(X.Xs)' rank 0 puts at the end of each epoch line (its own clock, 0.1 s steps)."""
    import re

    found = []
    for _, text in lines:
        if RankLog.EPOCH.match(text):
            m = re.search(r"\((\d+(?:\.\d+)?)s\)\s*$", text)
            if m:
                found.append(float(m.group(1)))
    return found


def sparktrain_accuracy(model, test_df) -> float:
    """Held-out accuracy from ``transform``'s ``label__output`` (2 logits per row)."""
    pdf = model.transform(test_df).select("label", "label__output").toPandas()
    predicted = np.stack(pdf["label__output"].to_numpy()).argmax(axis=1)
    return float((predicted == pdf["label"].to_numpy()).mean())


# -- the benchmark --------------------------------------------------------------------------------
def main_run(args, spark, tmp: str) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    import torch

    progress(f"generating {args.rows:,} + {args.test_rows:,} sentences (seed {args.seed}), "
             f"cached and counted")
    train_df, test_df, train_texts, test_texts, train_labels, test_labels = make_frames(
        spark, args.rows, args.test_rows, args.seed)
    tokenizer = train_tokenizer(train_texts, args.vocab_size, args.max_length)
    vocab_size = len(tokenizer)
    tokenize = Tokenize(tokenizer, args.max_length)
    lengths = [len(ids) for ids in tokenizer(train_texts[:2000], truncation=False)["input_ids"]]
    progress(f"tokenizer: {vocab_size} tokens; {max(lengths)} tokens in the longest of 2,000 "
             f"sentences (max_length {args.max_length}); e.g. {train_texts[0]!r}")

    def tensors(texts, labels) -> Dict[str, Any]:
        enc = tokenize({"text": texts, "label": labels})
        return {k: torch.from_numpy(np.ascontiguousarray(v)).long() for k, v in enc.items()}

    train_t, test_t = tensors(train_texts, train_labels), tensors(test_texts, test_labels)
    steps = schedule(args.rows, args.batch_size, args.epochs, args.warmup_ratio)
    warm_steps = schedule(WARMUP_ROWS, args.batch_size, 1, args.warmup_ratio)
    progress(f"{steps['per_epoch']} steps/epoch per rank, {steps['total']} in all, "
             f"{steps['warmup']} warm-up steps")
    state: Dict[str, Any] = {"rank_log": args.rank_log, "fit_log": args.fit_log, "hangs": []}
    meta = {"vocab_size": vocab_size, "steps": steps,
            "parameters": sum(p.numel() for p in make_model(vocab_size, 0).parameters()),
            "longest_sentence_tokens": max(lengths)}
    found: Dict[str, Any] = {}

    # The machine is shared: the contenders take turns, round after round (the order reversed
    # every other round), so that a change in load hits all of them alike. Every run records the
    # load average when it ends.
    contenders = [c for c in ("reference", "sparktrain", "trainer") if c not in args.skip]
    if "sparktrain" in contenders:
        missing = sparktrain_missing()
        if missing:
            progress(f"sparktrain: not run: {missing}")
            found["sparktrain_missing"] = missing
            contenders.remove("sparktrain")

    def reference(i: int) -> None:
        ref = run_reference(args, vocab_size, train_t, test_t, steps)
        pair = run_reference_pair(args, vocab_size, train_t, steps)
        ref["side_by_side"] = pair
        ref["load"] = os.getloadavg()[0]
        progress(f"reference {i + 1}/{args.repeats}: alone {ref['steps_per_s']:.1f} steps/s "
                 f"({ref['cpu_ms_per_step']:.1f} ms CPU/step), accuracy {ref['accuracy']:.4f} "
                 f"after {ref['steps']} steps; {NUM_PROC} side by side " + ", ".join(
                     f"{r['steps_per_s']:.1f}" for r in pair) + " steps/s")
        found.setdefault("reference", []).append(ref)

    def sparktrain(i: int) -> None:
        run = run_sparktrain(args, spark, train_df, test_df, vocab_size, tokenize, steps,
                             os.path.join(tmp, f"store-{i}"), args.epochs, state,
                             f"sparktrain: fit {i + 1}", True)
        run["load"] = os.getloadavg()[0]
        module = run.pop("model")
        run["accuracy"] = sparktrain_accuracy(module, test_df)
        run["accuracy_driver"] = evaluate(module.getModel(), test_t["input_ids"],
                                          test_t["attention_mask"], test_t["label"])
        progress(f"sparktrain {i + 1}/{args.repeats}: fit {run['seconds']:.2f}s (materialize "
                 f"{run['materialize_s'] or 0:.2f}s; rank 0's epochs "
                 f"{', '.join(f'{e:.1f}s' for e in run['ranks'][0]['epoch_s'])}), accuracy "
                 f"{run['accuracy']:.4f}")
        found.setdefault("sparktrain", []).append(run)

    def trainer(i: int) -> None:
        run = run_trainer(args, spark, train_df, vocab_size, tokenize, steps,
                          os.path.join(tmp, f"trainer-{i}"), args.epochs)
        run["load"] = os.getloadavg()[0]
        r0 = run["rank0"]
        if r0["world_size"] != NUM_PROC or run["rows"] != args.rows:
            raise AssertionError(f"trainer: world size {r0['world_size']}, {run['rows']} rows")
        if r0["global_step"] != steps["total"]:
            raise AssertionError(f"trainer: {r0['global_step']} steps, expected "
                                 f"{steps['total']}")
        run["accuracy"] = evaluate(run.pop("model"), test_t["input_ids"],
                                   test_t["attention_mask"], test_t["label"])
        progress(f"trainer {i + 1}/{args.repeats}: {run['seconds']:.2f}s (from_spark "
                 f"{run['from_spark_s']:.2f}s, map {run['map_s']:.2f}s, TorchDistributor "
                 f"{run['distributor_s']:.2f}s of which Trainer.train {r0['train_runtime']:.2f}s"
                 f"; backend {r0['backend']}, {r0['threads']} thread(s)/rank, "
                 f"{r0['train_steps_per_second']:.1f} steps/s), accuracy {run['accuracy']:.4f}; "
                 f"run() returned rank {run['returned_rank']}'s value")
        found.setdefault("trainer", []).append(run)

    # untimed warm-ups on a small frame: Spark's Python workers, imports, page cache
    small = cached(train_df.limit(WARMUP_ROWS).repartition(NUM_PROC))
    if "sparktrain" in contenders:
        seconds = run_sparktrain(args, spark, small, test_df, vocab_size, tokenize, warm_steps,
                                 os.path.join(tmp, "store-warmup"), 1, state,
                                 "sparktrain: warm-up fit", False)["seconds"]
        progress(f"sparktrain: warm-up fit ({WARMUP_ROWS} rows, 1 epoch) {seconds:.2f}s")
    if "trainer" in contenders:
        seconds = run_trainer(args, spark, small, vocab_size, tokenize, warm_steps,
                              os.path.join(tmp, "trainer-warmup"), 1)["seconds"]
        progress(f"trainer: warm-up run ({WARMUP_ROWS} rows, 1 epoch) {seconds:.2f}s")
    small.unpersist()
    runners = {"reference": reference, "sparktrain": sparktrain, "trainer": trainer}
    for i in range(args.repeats):
        order = contenders if i % 2 == 0 else contenders[::-1]
        progress(f"== round {i + 1}/{args.repeats}: {', '.join(order)} ==")
        for name in order:
            runners[name](i)
    found["hangs"] = state["hangs"]
    return make_figures(args, found, steps), {**meta, "hangs": state["hangs"]}


def sparktrain_rate(run: Dict[str, Any], per_epoch: int) -> Optional[float]:
    """One fit's steps/s per rank: steps per epoch / the median epoch of epochs 2..E of both
    ranks (their own clocks: no launch, reader start or teardown in them); with 1 epoch, of
    epoch 1 (the readers' start in it)."""
    epochs = [rank["epoch_s"] for rank in run["ranks"]]
    steady = [e for rank in epochs for e in rank[1:]]
    first = [rank[0] for rank in epochs if rank]
    return per_epoch / statistics.median(steady or first) if steady or first else None


def rounds(values_a: List[Optional[float]], values_b: List[Optional[float]]) -> str:
    """Per-round ratios a / b, as text."""
    return ", ".join(f"{a / b:.2f}x" for a, b in zip(values_a, values_b, strict=True) if a and b)


def make_figures(args, found: Dict[str, Any], steps: Dict[str, int]) -> List[Dict[str, Any]]:
    med = statistics.median
    st, tr, ref = found.get("sparktrain"), found.get("trainer"), found.get("reference")
    status = found.get("sparktrain_missing") or ("skipped" if "sparktrain" in args.skip else None)
    hangs = found.get("hangs", [])  # filled in by main_run
    loads = {name: ", ".join(f"{r['load']:.1f}" for r in runs)
             for name, runs in (("sparktrain", st), ("trainer", tr), ("reference", ref)) if runs}
    results = []

    # e2e
    extras: Dict[str, Any] = {}
    st_s = med([r["seconds"] for r in st]) if st else None
    tr_s = med([r["seconds"] for r in tr]) if tr else None
    if st:
        mat = [r["materialize_s"] for r in st if r["materialize_s"] is not None]
        if mat:
            extras["sparktrain: materialize (inside the fit)"] = {"value": med(mat), "unit": "s"}
        clocks = [(r["seconds"], r["ranks"][0]["epoch_s"]) for r in st if r["ranks"]]
        if clocks:
            extras["sparktrain: training epochs (rank 0's clock)"] = {
                "value": med([sum(e) for _, e in clocks]), "unit": "s"}
            extras["sparktrain: the rest (preflight, materialize, launch, model back)"] = {
                "value": med([s - sum(e) for s, e in clocks]), "unit": "s"}
            later = [e[0] - statistics.median(e[1:]) for _, e in clocks if len(e) > 1]
            if later:
                extras["sparktrain: epoch 1 minus a later epoch (readers and decode workers "
                       "starting)"] = {"value": med(later), "unit": "s"}
    if tr:
        for key, name in (("from_spark_s", "Dataset.from_spark(train_df)"),
                          ("map_s", ".map(tokenize, batched=True)"),
                          ("distributor_s", "TorchDistributor(local_mode=True).run(Trainer)")):
            extras[f"trainer: {name}"] = {"value": med([r[key] for r in tr]), "unit": "s"}
        extras["trainer: Trainer.train inside it (rank 0's train_runtime)"] = {
            "value": med([r["rank0"]["train_runtime"] for r in tr]), "unit": "s"}
    if st and tr:
        extras["speed-up in each round"] = {"value": rounds([r["seconds"] for r in tr],
                                                            [r["seconds"] for r in st])}
    for name, text in loads.items():
        extras[f"load average after each {name} run"] = {"value": text}
    extras["runs"] = {"sparktrain": st or [], "trainer": tr or []}
    extras.update(hang_extras(hangs, "sparktrain:"))
    results.append(figure(
        "e2e", f"wall s from the {args.rows:,}-row training DataFrame to a trained model, "
        f"{args.epochs} epoch(s), batch {args.batch_size}/rank, 2 ranks, median of "
        f"{args.repeats}; ratio = baseline s / sparktrain s", "s", st_s, tr_s,
        "Dataset.from_spark + map + TorchDistributor(local_mode=True).run(Trainer)",
        (tr_s / st_s) if st_s and tr_s else None, 2.0, ">=", extras))

    # accuracy
    extras = {}
    st_a = med([r["accuracy"] for r in st]) if st else None
    tr_a = med([r["accuracy"] for r in tr]) if tr else None
    if st:
        extras["sparktrain: getModel() evaluated in the driver (cross-check)"] = {
            "value": med([r["accuracy_driver"] for r in st]), "unit": "accuracy"}
    if ref:
        extras[f"reference loop ({ref[0]['steps']} steps of batch {args.batch_size}, 1 "
               f"process)"] = {"value": med([r["accuracy"] for r in ref]), "unit": "accuracy"}
    for name, value in (("sparktrain", st_a), ("trainer", tr_a)):
        if value is not None and value < 0.9:
            extras[f"{name} below 0.9"] = {"value": value, "unit": "accuracy",
                                           "note": "more --epochs or --rows"}
    results.append(figure("accuracy", f"held-out accuracy on {args.test_rows:,} rows (argmax of "
                          f"2 logits), median of {args.repeats}", "accuracy", st_a, tr_a,
                          "Trainer model, predicted in the driver",
                          (st_a / tr_a) if st_a is not None and tr_a else None, 0.99, ">=",
                          extras))

    # steps/s per rank
    extras = {}
    st_rates = [sparktrain_rate(r, steps["per_epoch"]) for r in st] if st else []
    st_rate = med([r for r in st_rates if r]) if any(st_rates) else None
    ref_rates = [r["steps_per_s"] for r in ref] if ref else []
    ref_rate = med(ref_rates) if ref_rates else None
    how = ("sparktrain not run" if not st else
           f"{steps['per_epoch']} steps / median epoch s of both ranks, "
           + (f"epochs 2..{args.epochs}" if args.epochs > 1 else "1 epoch: with the readers' "
              "start") + ", each on its own clock")
    if st:
        first = 0 if args.epochs == 1 else 1
        cpu = [c for r in st for rank in r["ranks"] for c in rank["cpu_ms_per_step"][first:]]
        if cpu:
            where = ("tokenization not included: it runs in the decode workers"
                     if args.reader_pool == "process" else "tokenization included")
            extras[f"sparktrain: CPU ms per step of a rank's process ({where})"] = {
                "value": med(cpu), "unit": "ms"}
        extras["sparktrain: epoch s of rank 0, each fit"] = {"value": "; ".join(
            ", ".join(f"{e:.2f}" for e in r["ranks"][0]["epoch_s"]) for r in st if r["ranks"])}
        gaps = [g for r in st for g in r["epoch_gaps_s"]]
        if gaps:
            extras["sparktrain: cross-check, gaps between rank 0's epoch lines on the driver"] = {
                "value": steps["per_epoch"] / med(gaps), "unit": "steps/s"}
        if ref:
            extras["ratio in each round"] = {"value": rounds(st_rates, ref_rates)}
    if ref:
        extras["reference: CPU ms per step (1 thread)"] = {
            "value": med([r["cpu_ms_per_step"] for r in ref]), "unit": "ms"}
        pair_rates = [statistics.mean(p["steps_per_s"] for p in r["side_by_side"]) for r in ref]
        pair_rate = med(pair_rates)
        note = f"{pair_rate / ref_rate:.2f}x the lone loop"
        if st_rate:
            note += f"; sparktrain {st_rate / pair_rate:.2f}x this (rounds: " \
                    f"{rounds(st_rates, pair_rates)})"
        extras[f"reference: {NUM_PROC} copies side by side, steps/s of each"] = {
            "value": pair_rate, "unit": "steps/s", "note": note}
    if tr:
        tr_rate = med([r["rank0"]["train_steps_per_second"] for r in tr])
        extras["trainer: steps/s per rank (global_step / train_runtime, all epochs)"] = {
            "value": tr_rate, "unit": "steps/s",
            "note": f"{tr_rate / ref_rate:.2f}x the reference" if ref_rate else ""}
        extras["trainer: CPU ms per step of rank 0's process (Trainer.train)"] = {
            "value": med([r["rank0"]["cpu_ms_per_step"] for r in tr]), "unit": "ms"}
    extras["runs"] = {"reference": ref or [], "sparktrain_steps_per_s": st_rates}
    results.append(figure("steps/s", f"optimizer steps/s of one rank ({how}) vs one process on "
                          f"in-memory tensors, 1 thread, batch {args.batch_size}", "steps/s",
                          st_rate, ref_rate, "single-process loop over in-memory tensors",
                          (st_rate / ref_rate) if st_rate and ref_rate else None, 0.8, ">=",
                          extras))
    if status:
        for r in results:
            if r["sparktrain"] is None:
                r["status"] = f"sparktrain side not run: {status}"
    return results


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--rows", type=int, default=None, help="training rows (default 20,000)")
    parser.add_argument("--test-rows", type=int, default=None,
                        help="held-out rows (default 2,000)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs (default 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--max-length", type=int, default=32, help="tokens per row (padded)")
    parser.add_argument("--vocab-size", type=int, default=512, help="WordPiece vocabulary")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--warmup-ratio", type=float, default=0.1,
                        help="share of the steps with a linear warm-up")
    parser.add_argument("--reader-pool", choices=("process", "thread"), default="thread",
                        help="sparktrain's reader_pool_type: tokenize in the training loop "
                             "(sparktrain's default for text) or in decode worker processes")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4,000 + 1,000 rows, 1 epoch, 1 repeat")
    add_common_args(parser, list(FIGURES), "bench_hf.json", fit_timeout=600.0)
    args = parse_common(parser, argv, list(FIGURES))
    quick = args.quick
    args.rows = args.rows or (4000 if quick else 20000)
    args.test_rows = args.test_rows or (1000 if quick else 2000)
    args.epochs = args.epochs or (1 if quick else 2)
    if quick and "--repeats" not in " ".join(argv if argv is not None else sys.argv):
        args.repeats = 1
    if args.rows < WARMUP_ROWS:
        parser.error(f"--rows must be at least {WARMUP_ROWS}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)
    # no network here: nothing may try the hub (inherited by TorchDistributor's processes)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("datasets").setLevel(logging.ERROR)

    # sparktrain's INFO lines to stderr; rank lines captured (epoch timing), not printed
    args.fit_log, args.rank_log = _FitLog(), RankLog()
    with sparktrain_logs(args.rank_log, args.fit_log), \
            local_session(args, "sparktrain-bench-hf", "sparktrain-bench-hf-") as (spark, tmp):
        load_before = os.getloadavg()
        results, run_meta = main_run(args, spark, tmp)

    title = (f"sparktrain Hugging Face benchmark: {args.rows:,} + {args.test_rows:,} rows, "
             f"{args.epochs} epoch(s), batch {args.batch_size}/rank, sparktrain reader pool "
             f"{args.reader_pool!r}, {args.master}, {load_note(load_before)}")
    report(results, args.json_out, lambda: {
        **run_meta, **arg_meta(args, "rows", "test_rows", "epochs", "batch_size", "max_length",
                               "lr", "warmup_ratio", "repeats", "master"),
        "skipped": sorted(args.skip), **arg_meta(args, "quick", "reader_pool"),
        **load_meta(load_before), **versions("transformers", "tokenizers", "datasets")}, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
