#!/usr/bin/env python
"""Benchmark generation over a DataFrame: sparktrain's ``TextGenerator`` (transformers'
continuous batching in each Python worker) against the recipe a user writes by hand,
``pyspark.ml.functions.predict_batch_udf`` around ``model.generate`` on padded batches.

    .venv/bin/python bench/bench_generate.py              # 256 rows, the CPU model, 2 repeats
    .venv/bin/python bench/bench_generate.py --quick      # 64 rows, 1 repeat
    .venv/bin/python bench/bench_generate.py --model large --rows 2048   # on a GPU

Both get the same rows (prompts of 8 to 256 tokens), the same Llama-style model built from a
config (``--model small``: 4 layers of 256; ``large``: 16 layers of 1024) and the same
tokenizer (a word list), and sample at temperature 1. The model's end-of-sequence logit is
biased so that an answer ends with probability 1/``--mean-answer`` at each token (capped at
``--max-new-tokens``): answers of mixed lengths, the case where a padded batch waits for its
longest answer. sparktrain's ``engine="static"`` (padded batches inside TextGenerator) is
measured too, so that the engine's share and the Spark plumbing's can be told apart.

Figures: ``tokens/s`` (generated tokens over the wall time of a ``count()``-forcing write of
every answer) and ``rows/s``, sparktrain against the hand-written UDF (ratio = sparktrain's
rate / the UDF's). Writes bench/results/bench_generate.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import figure, progress, report, versions  # noqa: E402

MODELS = {"small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4),
          "large": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=8)}
VOCAB = 2000


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 4)]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def model(kind: str, mean_answer: float, seed: int) -> Any:
    """A Llama from a config whose lm_head has a bias on the end-of-sequence token: with
    sampling at temperature 1 an answer ends with probability ~1/mean_answer per token."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=1024, eos_token_id=3,
                         pad_token_id=0, bos_token_id=2, **MODELS[kind])
    lm = LlamaForCausalLM(config).eval()
    head = torch.nn.Linear(config.hidden_size, VOCAB, bias=True)
    head.weight.data.copy_(lm.lm_head.weight.data)
    head.bias.data.zero_()
    with torch.no_grad():  # calibrate: the others' log-sum-exp on random prompts
        ids = torch.randint(4, VOCAB, (8, 64))
        logits = lm(input_ids=ids).logits[:, -1, :]
        others = torch.logsumexp(torch.cat([logits[:, :3], logits[:, 4:]], 1), 1).mean()
        p = 1.0 / mean_answer
        head.bias.data[3] = others + math.log(p / (1 - p)) - logits[:, 3].mean()
    lm.lm_head = head
    return lm


def prompts(rows: int, seed: int) -> List[str]:
    rng = np.random.default_rng(seed)
    lengths = rng.choice([8, 16, 32, 64, 128, 256], size=rows)
    return [" ".join(f"w{w}" for w in rng.integers(0, VOCAB - 4, n)) for n in lengths]


def hand_written(df: Any, lm: Any, tok: Any, args: Any) -> Any:
    """What a user writes: predict_batch_udf, left-padded batches, generate, decode."""
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import types as T

    max_new, batch = args.max_new_tokens, args.batch

    def make_predict_fn():
        import torch

        torch.set_num_threads(1)
        tok.padding_side = "left"

        def predict(texts):
            enc = tok(list(texts), return_tensors="pt", padding=True)
            with torch.inference_mode():
                out = lm.generate(**enc, max_new_tokens=max_new, do_sample=True,
                                  temperature=1.0, top_p=1.0, top_k=0,  # generate keeps 50 else
                                  eos_token_id=3, pad_token_id=0)
            new = out[:, enc["input_ids"].shape[1]:]
            return np.array(tok.batch_decode(new, skip_special_tokens=True), dtype=object)

        return predict

    udf = predict_batch_udf(make_predict_fn, return_type=T.StringType(), batch_size=batch)
    return df.withColumn("text", udf("prompt"))


def run_once(spark: Any, df: Any, build, out_dir: str, label: str) -> Dict[str, float]:
    """Wall seconds to write every answer, and the generated tokens (words) counted after."""
    path = os.path.join(out_dir, f"{label}-{time.time_ns()}")
    start = time.perf_counter()
    build(df).select("text").write.parquet(path)
    seconds = time.perf_counter() - start
    texts = [r["text"] for r in spark.read.parquet(path).collect()]
    tokens = sum(len(t.split()) for t in texts)
    return {"seconds": seconds, "tokens": tokens, "rows": len(texts)}


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--mean-answer", type=float, default=32.0)
    parser.add_argument("--batch", type=int, default=16,
                        help="the hand-written UDF's batch and TextGenerator's rows in flight")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json-out", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "bench_generate.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = 64, 1
    from sparktrain import TextGenerator, local_spark

    spark = local_spark(args.master, app_name="bench-generate")
    tok, lm = tokenizer(), model(args.model, args.mean_answer, args.seed)
    partitions = int(spark.sparkContext.defaultParallelism)
    df = spark.createDataFrame([(p,) for p in prompts(args.rows, args.seed)], "prompt string") \
        .repartition(partitions).cache()
    df.count()

    def ours(engine: str):
        generator = TextGenerator(model=lm, tokenizer=tok, promptCol="prompt",
                                  maxNewTokens=args.max_new_tokens, temperature=1.0,
                                  engine=engine, maxRowsInFlight=args.batch, seed=args.seed)
        return lambda d: generator.transform(d).withColumn("text", __import__(
            "pyspark.sql.functions", fromlist=["col"]).col("generated.text"))

    contenders = {"sparktrain": ours("continuous"), "sparktrain-static": ours("static"),
                  "hand-written": lambda d: hand_written(d, lm, tok, args)}
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory() as out_dir:
        for repeat in range(args.repeats + 1):  # the first: warm-up (workers load the model)
            for name, build in contenders.items():
                result = run_once(spark, df, build, out_dir, name)
                progress(f"{name} run {repeat}: {result['seconds']:.1f} s, "
                         f"{result['tokens']} tokens")
                if repeat:
                    runs[name].append(result)
    spark.stop()

    def rate(name: str, what: str) -> float:
        return float(np.median([r[what] / r["seconds"] for r in runs[name]]))

    results = []
    for what, unit in (("tokens", "tokens/s"), ("rows", "rows/s")):
        ours_rate, theirs = rate("sparktrain", what), rate("hand-written", what)
        results.append(figure(
            f"generate_{what}", f"{what} generated per second over {args.rows} rows, "
            f"model {args.model}, {args.master}", unit, ours_rate, theirs,
            "predict_batch_udf + model.generate", ours_rate / theirs, 1.5, ">=",
            {"static engine": {"value": rate("sparktrain-static", what), "unit": unit}}))
    report(results, args.json_out, lambda: {**versions("transformers"), **vars(args),
                                             "runs": runs},
           title=f"bench_generate: {args.rows} rows, model {args.model}")
    print(json.dumps({name: [round(r["seconds"], 2) for r in rs] for name, rs in runs.items()}))


if __name__ == "__main__":
    main()
