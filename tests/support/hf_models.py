"""Small Hugging Face parts for the tests: sentiment-like text, a WordPiece tokenizer trained in
memory, and a tiny BERT built from a config (nothing is downloaded)."""
from __future__ import annotations

import random
from typing import Any, Dict, List, Tuple

import numpy as np

POSITIVE = ["good", "great", "excellent", "love", "happy", "nice", "perfect", "fast"]
NEGATIVE = ["bad", "awful", "terrible", "hate", "sad", "poor", "broken", "slow"]
NEUTRAL = ["the", "product", "service", "was", "it", "support", "ticket", "order", "today",
           "really", "my", "a", "delivery", "team", "app", "and"]
MAX_LENGTH = 16


def sentences(n: int, seed: int = 0) -> List[Tuple[str, int]]:
    """``n`` rows of ``(text, label)``: neutral words around one or two words of the label's
    sentiment (1 positive, 0 negative)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randint(0, 1)
        words = rng.sample(NEUTRAL, rng.randint(3, 7))
        words += rng.sample(POSITIVE if label else NEGATIVE, rng.randint(1, 2))
        rng.shuffle(words)
        rows.append((" ".join(words), label))
    return rows


def tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` (WordPiece) over every word used here. The vocabulary is
    given, not trained: ``tokenizers``' WordPiece trainer was seen to build a different one in
    each process, which made the tests' accuracy vary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + sorted(set(POSITIVE + NEGATIVE + NEUTRAL))
    raw = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


class Tokenize:
    """``transformation_fn``: the ``text`` column to ``input_ids`` and ``attention_mask``
    (the label passes through when the batch has one: not at predict time)."""

    def __init__(self, tok: Any, max_length: int = MAX_LENGTH) -> None:
        self.tok, self.max_length = tok, max_length

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        encoded = self.tok(list(batch["text"]), padding="max_length", truncation=True,
                           max_length=self.max_length, return_tensors="np")
        out = {"input_ids": encoded["input_ids"].astype("int64"),
               "attention_mask": encoded["attention_mask"].astype("int64")}
        if "label" in batch:
            out["label"] = batch["label"]
        return out


def tiny_bert(vocab_size: int, seed: int = 0) -> Any:
    """A 2-layer ``BertForSequenceClassification`` with 2 labels, from a config."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=MAX_LENGTH * 2, num_labels=2)
    return BertForSequenceClassification(config)


def accuracy(predictions: Any, column: str = "label__output") -> float:
    """Share of rows whose argmax of the logits column equals ``label``."""
    rows = predictions.select("label", column).collect()
    return float(np.mean([int(np.argmax(r[column])) == r["label"] for r in rows]))
