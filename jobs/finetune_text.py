#!/usr/bin/env python
"""Fine-tune a Hugging Face text classifier on a Spark DataFrame with TorchEstimator and LoRA.

    # the demo: synthetic support tickets (positive / negative), a WordPiece tokenizer whose
    # vocabulary is counted in memory, a small BERT from a config, LoRA; 2 ranks, no download
    python jobs/finetune_text.py --demo

    # your model and data: a local Hugging Face checkpoint directory (config, weights,
    # tokenizer files) and a Parquet/CSV file or folder with text and label columns
    spark-submit --master yarn jobs/finetune_text.py --model /models/distilbert-base-uncased \\
        --data hdfs:///data/tickets.parquet --num-proc 4 --epochs 3 --max-length 128 \\
        --store hdfs:///user/me/sparktrain --output hdfs:///models/tickets \\
        --export /models/tickets-hf

The DataFrame keeps its raw text: the store holds the text column, each rank's decode worker
processes tokenize it per batch (``transformation_fn``), and the model is called with the
``input_ids`` and ``attention_mask`` the tokenizer made, by keyword, with ``labels=``: it
computes its own loss (``loss=None``). Only the LoRA adapters and the classifier head train
(``--lora-r 0``: every weight); the learning rate warms up linearly, then decays linearly to 0
over the run's optimizer steps. The fitted model predicts on raw text, is saved, reloaded and
must predict the same; ``--export`` also writes the merged model and the tokenizer as a
Hugging Face checkpoint (``save_pretrained``). docs/huggingface.md explains each step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobs.common import get_spark, require  # noqa: E402 - after sys.path is set

# -- the demo's data ----------------------------------------------------------------------------
SUBJECTS = ["my order", "the delivery", "the refund", "your support team", "the app",
            "the latest update", "the invoice", "the replacement", "the agent", "the checkout",
            "my account", "the package", "the courier", "the website", "the subscription"]
PRAISE = ["arrived early", "works perfectly", "was resolved quickly", "was really helpful",
          "is great", "exceeded my expectations", "was processed fast", "fixed my problem",
          "is easy to use", "was friendly and patient", "came in perfect condition",
          "answered within minutes"]
COMPLAINTS = ["arrived damaged", "keeps crashing", "was never processed", "was rude",
              "is broken", "still has not arrived", "charged me twice", "did not fix anything",
              "is impossible to use", "ignored my emails", "came with parts missing",
              "logs me out every hour"]
OPENERS = ["hi", "hello", "dear support", "ticket update", "quick note", "fyi", "good morning"]
CLOSERS = {1: ["thank you", "great job", "will order again", "much appreciated", "love it"],
           0: ["very disappointed", "please help", "i want a refund", "this is unacceptable",
               "fix this now"]}
NEUTRAL_CLOSERS = ["regards", "sent from my phone", "see attached screenshot", "thanks in advance"]
LABELS = ["negative", "positive"]  # label 0, label 1


def ticket_rows(n: int, seed: int) -> List[Tuple[int, str, int]]:
    """``n`` deterministic ``(id, text, label)`` support tickets: an opener, one or two
    clauses ``<subject> <praise|complaint>`` and a closer (of the label's tone, or neutral);
    label 1 positive, 0 negative. Every ticket carries an order number, and subjects, openers
    and neutral closers appear in both classes."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = rng.randint(0, 1)
        predicates = PRAISE if label else COMPLAINTS
        words = []
        if rng.random() < 0.7:
            words.append(rng.choice(OPENERS))
        words.append(f"order {rng.randint(1000, 99999)}:")
        pairs = zip(rng.sample(SUBJECTS, 2), rng.sample(predicates, 2), strict=True)
        clauses = [f"{s} {p}" for s, p in pairs]
        words.append(" and ".join(clauses[:rng.randint(1, 2)]))
        words.append(rng.choice(CLOSERS[label] if rng.random() < 0.5 else NEUTRAL_CLOSERS))
        rows.append((i, " ".join(words), label))
    return rows


def train_tokenizer(texts: Sequence[str], min_count: int = 2) -> Any:
    """A WordPiece ``PreTrainedTokenizerFast`` (BERT's normalizer, pre-tokenizer and special
    tokens, lower-cased) whose vocabulary is learned in memory from ``texts``: every word seen
    ``min_count`` times or more, and every character alone and as a ``##`` continuation, so
    that rarer words (the order numbers) split into pieces.

    The vocabulary is counted here rather than by ``tokenizers``' ``WordPieceTrainer``, whose
    merges break ties in a different order in every process: the same texts would give another
    vocabulary, other token ids and another accuracy on every run."""
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words: Counter = Counter()
    for text in texts:
        words.update(w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in words for c in word})
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens = special + chars + [f"##{c}" for c in chars] + \
        sorted(w for w, n in words.items() if n >= min_count and len(w) > 1)
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    raw = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.normalizer, raw.pre_tokenizer = normalizer, pre_tokenizer
    raw.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    raw.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def small_bert(vocab_size: int, labels: Sequence[str], max_length: int, seed: int) -> Any:
    """A 2-layer ``BertForSequenceClassification`` (hidden size 64) built from a config, with a
    head for ``labels``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=max_length, id2label=dict(enumerate(labels)),
                        label2id={name: i for i, name in enumerate(labels)})
    return BertForSequenceClassification(config)


# -- what the ranks run -------------------------------------------------------------------------
class Tokenize:
    """``transformation_fn``: the text column to ``input_ids`` and ``attention_mask``, padded
    to ``max_length`` (one shape per column); the label passes through when the batch has one
    (it has none at prediction time). Runs in the decode worker processes of each rank, on the
    driver (8 rows, to learn that it reads only the text column) and in ``transform``."""

    def __init__(self, tokenizer: Any, max_length: int, text_col: str = "text",
                 label_col: str = "label") -> None:
        self.tokenizer, self.max_length = tokenizer, max_length
        self.text_col, self.label_col = text_col, label_col

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        encoded = self.tokenizer([str(t) for t in batch[self.text_col]], padding="max_length",
                                 truncation=True, max_length=self.max_length,
                                 return_tensors="np")
        out = {"input_ids": encoded["input_ids"].astype(np.int64),
               "attention_mask": encoded["attention_mask"].astype(np.int64)}
        if self.label_col in batch:
            out[self.label_col] = batch[self.label_col]
        return out


class WarmupThenDecay:
    """``lr_scheduler``: the rate rises linearly over ``warmup`` optimizer steps, then falls
    linearly to 0 at ``total`` (``transformers.get_linear_schedule_with_warmup``, whose first
    step runs at rate 0). Built on each rank with the rank's optimizer; stepped after every
    optimizer step."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, max(total, 1)

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))

    def __call__(self, optimizer: Any) -> Any:
        import torch

        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)


def optimizer_steps(rows: int, num_proc: int, batch_size: int, passes: int, epochs: int) -> int:
    """Optimizer steps of a fit: every rank runs ``ceil(rows / num_proc / batch_size)`` batches
    per epoch and steps after every ``passes`` of them (and after the last)."""
    batches = math.ceil(rows / num_proc / batch_size)
    return epochs * math.ceil(batches / passes)


def with_lora(model: Any, r: int, target_modules: Optional[List[str]],
              modules_to_save: Optional[List[str]]) -> Any:
    """``model`` with LoRA adapters (``peft.get_peft_model``): the base weights frozen, the
    adapters and ``modules_to_save`` (the classifier head) trainable. ``target_modules=None``:
    peft's default for the architecture."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=target_modules,
                        modules_to_save=modules_to_save, task_type="SEQ_CLS")
    return get_peft_model(model, config)


def accuracy(output: Any, label: Any) -> Any:
    """Fraction of rows whose highest logit is the label (a metric; ``output`` is the logits)."""
    return (output.argmax(dim=1) == label).float().mean()


# -- the job ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--demo", action="store_true",
                        help="synthetic support tickets and a small BERT (no download)")
    source.add_argument("--model", metavar="DIR",
                        help="a local Hugging Face checkpoint directory to fine-tune "
                             "(AutoModelForSequenceClassification, AutoTokenizer)")
    p.add_argument("--data", metavar="PATH",
                   help="with --model: Parquet or CSV (a file or a folder; any Hadoop "
                        "filesystem) with the text and label columns")
    p.add_argument("--text-col", default="text")
    p.add_argument("--label-col", default="label",
                   help="integer class ids, or strings (indexed in sorted order)")
    p.add_argument("--rows", type=int, default=4000, help="--demo: tickets to generate")
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per row, padded or truncated (default: 32 with --demo, 128)")
    p.add_argument("--lora-r", type=int, default=8,
                   help="LoRA rank; 0 fine-tunes every weight instead")
    p.add_argument("--lora-targets", default=None,
                   help="comma-separated module names for the adapters (default: query,value "
                        "with --demo, else peft's default for the architecture)")
    p.add_argument("--num-proc", type=int, default=2, help="training processes (barrier tasks)")
    p.add_argument("--epochs", type=int, default=None, help="default: 5 with --demo, 3")
    p.add_argument("--batch-size", type=int, default=32, help="rows per batch per process")
    p.add_argument("--backward-passes", type=int, default=1,
                   help="batches whose gradients are accumulated per optimizer step")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW peak learning rate (default: 1e-2 with --demo, 2e-4 with LoRA, "
                        "3e-5 without)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.1,
                   help="warm-up: a fraction of the optimizer steps (< 1) or a number of steps")
    p.add_argument("--bf16", action="store_true", help="mixed_precision='bf16' (CPU or GPU)")
    p.add_argument("--decode-workers", type=int, default=1,
                   help="tokenizing processes per rank (train_reader_num_workers)")
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--validation", type=float, default=0.1,
                   help="fraction of training rows held out for per-epoch validation")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--store", default=None, help="sparktrain store (default: a local temp dir)")
    p.add_argument("--output", default=None, help="where to save the fitted TorchModel")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="also save the merged model and the tokenizer with save_pretrained")
    p.add_argument("--run-id", default=None,
                   help="name of the run in the store; the same id resumes from its checkpoint")
    p.add_argument("--max-time", type=float, default=None,
                   help="stop training at the end of the epoch after this many seconds")
    p.add_argument("--use-gpu", choices=["auto", "yes", "no"], default="auto",
                   help="train on the GPUs Spark assigns to tasks (auto: when tasks have GPUs)")
    p.add_argument("--backend", choices=["torch", "horovod"], default="torch",
                   help="distributed engine (default: torch)")
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp",
                   help="how ranks hold the model (default: ddp; fsdp: sharded across ranks)")
    session = p.add_mutually_exclusive_group()
    session.add_argument("--master", default=None,
                         help="Spark master when not set by spark-submit (default: local[*]; "
                              "--demo: a slot per rank, local[2])")
    session.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                         help="use a Spark Connect server instead of embedded Spark")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="fail if test accuracy is lower (the demo uses 0.9)")
    args = p.parse_args(list(argv))
    if not (args.demo or args.model):
        p.error("one of --demo or --model is required")
    if args.model and not args.data:
        p.error("--data is required with --model")
    if args.demo and args.data:
        p.error("--data goes with --model; --demo generates its own tickets")
    if args.model and not os.path.isdir(args.model):
        p.error(f"--model {args.model}: not a directory (a local Hugging Face checkpoint; "
                f"nothing is downloaded)")
    if args.max_length is None:
        args.max_length = 32 if args.demo else 128
    if args.epochs is None:
        args.epochs = 5 if args.demo else 3
    if args.lr is None:
        args.lr = 1e-2 if args.demo else (2e-4 if args.lora_r > 0 else 3e-5)
    if args.demo and args.min_accuracy is None:
        args.min_accuracy = 0.9
    return args


def read_data(spark: Any, path: str) -> Any:
    """A Parquet or CSV (header row) file or folder as a DataFrame."""
    if path.rstrip("/").lower().endswith((".csv", ".csv.gz")):
        return spark.read.csv(path, header=True, inferSchema=True, multiLine=True, escape='"')
    return spark.read.parquet(path)


def index_labels(df: Any, label: str) -> Tuple[Any, List[str]]:
    """``df`` with integer labels, and the class names: string labels become their index in
    sorted order; integer labels stay (names ``"0"``, ``"1"``...)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    dtype = df.schema[label].dataType
    if isinstance(dtype, T.StringType):
        names = sorted(r[0] for r in df.select(label).distinct().limit(10_001).collect()
                       if r[0] is not None)
        if len(names) > 10_000:
            raise ValueError(f"label column {label!r} has more than 10000 distinct strings")
        mapping = F.create_map(*[F.lit(x) for pair in enumerate(names) for x in pair[::-1]])
        return df.withColumn(label, mapping[F.col(label)].cast("long")), names
    if not isinstance(dtype, (T.IntegerType, T.LongType, T.ShortType, T.ByteType)):
        raise ValueError(f"label column {label!r} is {dtype.simpleString()}; expected integer "
                         f"class ids or strings")
    top = df.agg(F.max(label)).first()[0]
    return df.withColumn(label, F.col(label).cast("long")), [str(i) for i in range(top + 1)]


def build(args: argparse.Namespace, train_texts: Optional[List[str]], labels: List[str]
          ) -> Tuple[Any, Any]:
    """``(tokenizer, model)``: the demo's in-memory tokenizer and small BERT, or the
    checkpoint's; with LoRA adapters unless ``--lora-r 0``."""
    import torch

    if args.demo:
        tokenizer = train_tokenizer(train_texts)
        model = small_bert(len(tokenizer), labels, args.max_length, args.seed)
        targets, heads = ["query", "value"], ["classifier"]
    else:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        torch.manual_seed(args.seed)  # the new head's initial weights
        # id2label sets num_labels (passing both warns when the checkpoint had other classes);
        # a head trained for other classes is replaced by a new one of the right size
        model = AutoModelForSequenceClassification.from_pretrained(
            args.model, id2label=dict(enumerate(labels)),
            label2id={name: i for i, name in enumerate(labels)}, ignore_mismatched_sizes=True)
        if tokenizer.pad_token is None:  # decoder-only models (GPT-2, Llama): pad with EOS
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:  # where the last real token is, for their head
            model.config.pad_token_id = tokenizer.pad_token_id
        targets, heads = None, None  # peft's defaults for the architecture and task
    if args.lora_targets:
        targets = args.lora_targets.split(",")
    if args.lora_r > 0:
        model = with_lora(model, args.lora_r, targets, heads)
    return tokenizer, model


def evaluate(predictions: Any, label: str, output_col: str) -> float:
    from pyspark.sql import functions as F

    predicted = F.expr(f"array_position(`{output_col}`, array_max(`{output_col}`)) - 1")
    return predictions.select(F.avg((predicted == F.col(label)).cast("double"))).first()[0]


def trainable_share(model: Any) -> Tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(argv)
    require(["transformers", "tokenizers", "peft"], "--hf", "hf")
    # peft calls a transformers method that transformers 5 deprecated: nothing to act on here
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                            category=FutureWarning)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # bars redrawn with \r are noise in a job's (YARN) log
    from pyspark.sql import functions as F

    from sparktrain import TorchEstimator, TorchModel

    workdir = tempfile.mkdtemp(prefix="sparktrain-text-")
    master = args.master
    if args.demo and master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = f"local[{max(2, args.num_proc)}]"  # a slot per rank, whatever the cores
    spark = get_spark(master, "sparktrain-finetune-text", args.remote)
    text, label = args.text_col, args.label_col
    if args.demo:
        # from pandas, Spark takes the rows as Arrow batches
        import pandas as pd

        frame = pd.DataFrame(ticket_rows(args.rows, args.seed), columns=["id", text, label])
        df, labels = spark.createDataFrame(frame), list(LABELS)
    else:
        df = read_data(spark, args.data)
        missing = [c for c in (text, label) if c not in df.columns]
        if missing:
            print(f"error: {args.data} has no column(s) {missing}; its columns: {df.columns} "
                  f"(--text-col, --label-col)", file=sys.stderr)
            return 2
        df, labels = index_labels(df.where(F.col(text).isNotNull() & F.col(label).isNotNull())
                                  .withColumn("id", F.monotonically_increasing_id()), label)
    train_df, test_df = df.randomSplit([1 - args.test_fraction, args.test_fraction], args.seed)
    train_df, test_df = train_df.cache(), test_df.cache()
    train_rows, test_rows = train_df.count(), test_df.count()
    texts = [r[0] for r in train_df.select(text).collect()] if args.demo else None
    tokenizer, model = build(args, texts, labels)
    trainable, total = trainable_share(model)
    print(f"{train_rows} training rows, {test_rows} test rows, {len(labels)} classes; "
          f"model {type(model).__name__}: {trainable:,} of {total:,} parameters train "
          f"({100 * trainable / total:.1f}%)", flush=True)

    fit_rows = int(train_rows * (1 - (args.validation or 0.0)))
    steps = optimizer_steps(fit_rows, args.num_proc, args.batch_size, args.backward_passes,
                            args.epochs)
    warmup = int(args.warmup * steps) if args.warmup < 1 else int(args.warmup)
    tokenize = Tokenize(tokenizer, args.max_length, text, label)
    # only the trainable parameters: LoRA's frozen base weights get no optimizer state
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.lr, weight_decay=args.weight_decay)
    est = TorchEstimator(
        num_proc=args.num_proc, model=model, optimizer=optimizer,
        loss=None,  # the model's own loss: it is called with labels=
        metrics=[accuracy],  # gets the output's logits
        transformation_fn=tokenize, feature_cols=["input_ids", "attention_mask"],
        label_cols=[label], batch_size=args.batch_size, epochs=args.epochs,
        backward_passes_per_step=args.backward_passes,
        lr_scheduler=WarmupThenDecay(warmup, steps), lr_scheduler_interval="step",
        mixed_precision="bf16" if args.bf16 else None,
        reader_pool_type="process", train_reader_num_workers=args.decode_workers,
        val_reader_num_workers=args.decode_workers,
        validation=args.validation or None, random_seed=args.seed,
        store=args.store or os.path.join(workdir, "store"), run_id=args.run_id,
        max_time=args.max_time, use_gpu={"auto": None, "yes": True, "no": False}[args.use_gpu],
        backend=args.backend, strategy=args.strategy, verbose=1)
    started = time.perf_counter()
    fitted = est.fit(train_df.select(text, label))
    fit_seconds = time.perf_counter() - started
    print("\nhistory (per epoch):")
    for key, values in fitted.getHistory().items():
        print(f"  {key:>14}: " + " ".join(f"{v:.4f}" for v in values))

    output_col = f"{label}__output"
    scored = fitted.transform(test_df).cache()  # reads only the text column
    score = evaluate(scored, label, output_col)
    print(f"\ntest accuracy: {score:.4f} on {test_rows} rows (fit {fit_seconds:.1f}s, "
          f"{args.num_proc} ranks, backend {args.backend}, {steps} optimizer steps)", flush=True)
    for row in fitted.transform(test_df.select(text)).limit(3).collect():  # raw text only
        logits = row[output_col]
        print(f"  {labels[int(np.argmax(logits))]:>10}  {row[text][:70]}")

    output = args.output or os.path.join(workdir, "model")
    fitted.write().overwrite().save(output)
    reloaded = TorchModel.load(output)
    before = scored.orderBy("id").select(label, output_col).toPandas()
    first = np.stack(before[output_col])
    again = np.stack(reloaded.transform(test_df).orderBy("id").select(output_col)
                     .toPandas()[output_col])
    same = bool(np.allclose(first, again, rtol=1e-5, atol=1e-6))
    again_score = float(np.mean(again.argmax(1) == before[label].to_numpy()))
    print(f"saved to {output}; reloaded model's test accuracy: {again_score:.4f}", flush=True)
    if args.export:
        export(fitted.getModel(), tokenizer, args.export)
        print(f"exported the merged model and tokenizer to {args.export}", flush=True)
    print(json.dumps({"test_accuracy": score, "reloaded_test_accuracy": again_score,
                      "fit_seconds": round(fit_seconds, 2), "model_path": output,
                      "trainable_parameters": trainable, "parameters": total}))

    if not same:
        print("error: the reloaded model predicts differently", file=sys.stderr)
        return 1
    if args.min_accuracy is not None and score < args.min_accuracy:
        print(f"error: test accuracy {score:.4f} < {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


def export(model: Any, tokenizer: Any, folder: str) -> None:
    """The fitted model as a Hugging Face checkpoint: LoRA merged into the base weights
    (``merge_and_unload``, in place: the job's last use of the model), then
    ``save_pretrained`` of the model and the tokenizer."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
