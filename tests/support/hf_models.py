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


# -- a causal language model that learns to count ------------------------------------------------
COUNT_WORDS = ["<pad>", "<unk>", "<s>", "</s>", "count", "from", ":"] + [str(i) for i in range(40)]
COUNT_LENGTH = 20  # tokens of prompt + answer + end-of-sequence, padded


def count_rows(n: int, seed: int = 0, step: int = 1) -> List[Tuple[str, str]]:
    """``n`` rows of ``(prompt, answer)``: "count 3 from 7 :" -> "8 9 10" (``step=2``: "9 11
    13", a new task for the same prompts). Answers have 1 to 8 numbers: mixed lengths, each
    ended by the model's end-of-sequence token once learned."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start, k = rng.randint(0, 20), rng.randint(1, 8)
        rows.append((f"count {k} from {start} :",
                     " ".join(str(start + step * i) for i in range(1, k + 1))))
    return rows


def count_tokenizer() -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over the counting task's words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(COUNT_WORDS)},
                                     unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def tiny_llama(seed: int = 0, context: int = 64) -> Any:
    """A 2-layer ``LlamaForCausalLM`` over :data:`COUNT_WORDS`, from a config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(COUNT_WORDS), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, eos_token_id=3, pad_token_id=0,
                         bos_token_id=2)
    return LlamaForCausalLM(config)


class CountTokenize:
    """``transformation_fn`` for the counting task: ``prompt`` + ``answer`` + end-of-sequence
    as ``input_ids``, and ``labels`` that score the answer only (-100 elsewhere)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        ids = np.zeros((len(batch["prompt"]), COUNT_LENGTH), dtype="int64")
        labels = np.full_like(ids, -100)
        for i, (prompt, answer) in enumerate(zip(batch["prompt"], batch["answer"], strict=True)):
            p = self.tok(str(prompt))["input_ids"]
            a = self.tok(str(answer))["input_ids"] + [self.tok.eos_token_id]
            row = (p + a)[:COUNT_LENGTH]
            ids[i, :len(row)] = row
            labels[i, len(p):len(row)] = a[:len(row) - len(p)]
        return {"input_ids": ids, "attention_mask": (ids != 0).astype("int64"), "labels": labels}


def train_counting(steps: int = 250, seed: int = 0) -> Any:
    """The tiny Llama trained on the counting task in this process (a few seconds): greedy
    decoding then answers every prompt exactly."""
    import torch

    model, tok = tiny_llama(seed), count_tokenizer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    encode = CountTokenize(tok)
    rows = count_rows(steps * 64, seed)
    for step in range(steps):
        chunk = rows[step * 64:(step + 1) * 64]
        batch = encode({"prompt": np.array([p for p, _ in chunk]),
                        "answer": np.array([a for _, a in chunk])})
        loss = model(**{k: torch.from_numpy(v) for k, v in batch.items()}).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


# -- a byte-level tokenizer for JSON answers ------------------------------------------------------
def byte_tokenizer() -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained in memory on a few JSON lines: every
    byte has a token, as in GPT-2's and Llama 3's, so any JSON can be written."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    lines = [json.dumps({"answer": word, "n": i, "ok": i % 2 == 0})
             for i, word in enumerate(["yes", "no", "maybe", "count", "from"] * 20)]
    raw.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>")


def untrained_llama(vocab_size: int, seed: int = 0) -> Any:
    """A 2-layer ``LlamaForCausalLM`` with random weights: left to itself it writes noise."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(config).eval()
