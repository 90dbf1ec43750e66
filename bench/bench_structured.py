#!/usr/bin/env python
"""Benchmark answers shaped by a schema: what llguidance's constraint costs per decoding step
against the same engine decoding freely, as the vocabulary grows (the mask is as wide as the
vocabulary), and how many answers parse with and without it.

    .venv/bin/python bench/bench_structured.py            # vocabularies 1k, 8k, 32k
    .venv/bin/python bench/bench_structured.py --quick    # 1k and 8k, fewer rows

For each vocabulary size: a byte-level BPE tokenizer trained in memory on synthetic words, the
small Llama-style config of bench_generate.py (4 layers of 256, random weights, so answers
are noise without the constraint) and 64 prompts through each of sparktrain's engines (static:
``generate`` with the constraint as a logits processor, batches of 16; continuous: the
constraint inside transformers' continuous batching, 16 rows in flight), greedy, at most 64 new
tokens: once free and once with a JSON schema (an enum, a string of at most 48 characters, an
integer 0..999). Figures: the constrained run's seconds against the same run less the
constraint's own time (measured around its calls: ratio = what the constraint adds), its
milliseconds per decoding step, constrained tokens/s, and the share of answers that parse with
and without it. (Seconds per step of the free and constrained runs are not compared:
constrained answers are shorter, so the prompts' prefill weighs more in each of their steps.)
No Spark: the engines alone, so the figures
are the constraint's. Writes bench/results/bench_structured.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, progress, report, versions  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "why", "n"],
          "properties": {"answer": {"enum": ["yes", "no", "unsure"]},
                         "why": {"type": "string", "maxLength": 48},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
SMALL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4)


def tokenizer(vocab: int) -> Any:
    """A byte-level BPE of ``vocab`` tokens trained on random words (a few seconds at 32k)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(60000)]
    lines = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(20000)]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>")


#: where each engine spends the constraint's time: (module, class, methods)
CONSTRAINTS = {"static": ("sparktrain.generation.json_constraint", "JsonConstraint",
                          ("__call__",)),
               "continuous": ("sparktrain.generation.cb_processors", "GrammarProcessor",
                              ("__call__", "prepare_tensor_args"))}


def decode(engine_name: str, model: Any, tok: Any, prompts: List[str],
           schema: str) -> Dict[str, Any]:
    """An engine over ``prompts`` (after a warm-up of 16 that builds its manager and
    llguidance's tokenizer): seconds, the constraint's seconds and steps, tokens, and the share
    of answers that parse as JSON."""
    import importlib

    from sparktrain.generation.engines import Request, engine_class
    from sparktrain.generation.settings import GenerationSettings

    module, name, methods = CONSTRAINTS[engine_name]
    kind = getattr(importlib.import_module(module), name)
    spent, calls = [0.0], [0]
    originals = {method: getattr(kind, method) for method in methods}

    def timed(method: str) -> Any:
        def run(self: Any, *args: Any) -> Any:
            start = time.perf_counter()
            try:
                return originals[method](self, *args)
            finally:
                spent[0] += time.perf_counter() - start
                calls[0] += method == "__call__"
        return run

    settings = GenerationSettings(max_new_tokens=64, json_schema=schema)
    engine = engine_class(engine_name)(model, settings, [tok.eos_token_id], tok.pad_token_id,
                                       16, tokenizer=tok)
    requests = [Request(i, tok(p)["input_ids"]) for i, p in enumerate(prompts)]
    for method in methods:
        setattr(kind, method, timed(method))
    try:
        list(engine.generate(requests[:16]))
        spent[0], calls[0] = 0.0, 0
        start = time.perf_counter()
        done = list(engine.generate(requests))
        seconds = time.perf_counter() - start
    finally:
        for method, original in originals.items():
            setattr(kind, method, original)
        engine.close()
    parsed = 0
    for d in done:
        try:
            json.loads(tok.decode(d.tokens, skip_special_tokens=True))
            parsed += 1
        except ValueError:
            pass
    return {"seconds": seconds, "constraint_seconds": spent[0], "steps": calls[0],
            "parsed": parsed / len(done), "tokens": sum(len(d.tokens) for d in done)}


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results",
                                                       "bench_structured.json"))
    args = parser.parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(2)
    rows = 32 if args.quick else args.rows
    prompts = [f"row {i}: is it good? answer in JSON" for i in range(rows)]
    results = []
    for vocab in ((1024, 8192) if args.quick else (1024, 8192, 32000)):
        progress(f"vocabulary {vocab}: training the tokenizer")
        tok = tokenizer(vocab)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), max_position_embeddings=256,
                                             eos_token_id=tok.eos_token_id,
                                             pad_token_id=tok.pad_token_id, **SMALL)).eval()
        for engine in ("static", "continuous"):
            free = decode(engine, model, tok, prompts, "")
            shaped = decode(engine, model, tok, prompts, json.dumps(SCHEMA))
            own = shaped["constraint_seconds"]
            progress(f"vocabulary {vocab}, {engine}: free {free}, shaped {shaped}")
            results.append(figure(
                f"constrained decoding, {engine}, vocabulary {vocab}",
                "seconds to answer the rows", "s", shaped["seconds"], shaped["seconds"] - own,
                "the same steps without the constraint",
                shaped["seconds"] / (shaped["seconds"] - own), 1.25, "<=", extras={
                    "constraint ms per step (16 rows)": round(
                        1000 * own / max(shaped["steps"], 1), 2),
                    "constrained tokens/s": round(shaped["tokens"] / shaped["seconds"]),
                    "answers that parse, constrained": shaped["parsed"],
                    "answers that parse, free": free["parsed"]}))
    report(results, args.json, lambda: {"versions": versions("transformers", "llguidance"),
                                        "rows": rows})


if __name__ == "__main__":
    main()
