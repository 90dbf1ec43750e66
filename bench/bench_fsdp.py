#!/usr/bin/env python
"""Per-rank memory and speed of ``TorchEstimator(strategy="ddp")`` against ``strategy="fsdp"``:
the same ~55M-parameter MLP, Adam, the same data and the same two ``local[2]`` slots.

    .venv/bin/python bench/bench_fsdp.py                          # 320 rows, 2 epochs (~4-5 min)
    .venv/bin/python bench/bench_fsdp.py --activation-checkpointing   # + one fsdp fit with it
    .venv/bin/python bench/bench_fsdp.py --rows 160 --epochs 2 --hidden 2048   # quick look

Every rank measures itself from a callback (``RankProbe``, run on every rank, see
bench/README.md) and writes one JSON file into a temp folder the driver then reads:

* parameter bytes it holds (a sharded parameter, ``DTensor``, counts its local shard), and,
  from a global optimizer step post-hook (``torch.optim.optimizer.
  register_optimizer_step_post_hook``), the bytes of the optimizer *that steps* (with fsdp the
  rank rebuilds it over the shards) and of the gradients it steps with;
* its RSS: at ``on_train_begin`` (model placed/sharded), the peak while training steps run,
  the peak at epoch ends (metrics, the rank-0 checkpoint), sampled every 10 ms by a thread,
  and ``getrusage(RUSAGE_SELF).ru_maxrss`` (the process's high-water mark since it started);
* its samples/s per epoch: rows its forward passes saw / seconds from the epoch's first
  forward to ``on_epoch_end`` (the epoch-end checkpoint excluded).

Figures (ratios fsdp / ddp, per rank, the larger of the two ranks on each side):

  state   parameter + optimizer-state bytes held          target <= 0.6x (issue 12)
  rss     peak RSS while the training steps run            target <= 1.0x (lower under fsdp)

and, without a target, samples/s (both ranks together, last epoch) and fit wall time.
Prints progress to stderr, per-strategy tables, the figure table and one JSON line per
figure to stdout, and writes --json-out (default bench/results/bench_fsdp.json) and the same
tables as markdown next to it (.md).
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

from common import (
    add_common_args,
    arg_meta,
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
    versions,
)

FIGURES: List[str] = []  # the two figures always run; --skip has nothing to skip
MIB = 2 ** 20
STATE_TARGET = 0.6
RSS_TARGET = 1.0


# -- what runs on every rank (pickled by value: this file runs as __main__) --------------------
def _local_bytes(t: Any) -> int:
    """Bytes this rank holds for ``t``: a ``DTensor``'s local shard, else the tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class RankProbe:
    """A sparktrain callback (on_train_begin / on_epoch_end / on_train_end, run on every rank)
    measuring the rank's memory and speed; writes ``<out_dir>/<tag>-rank<r>.json`` at the end.

    Example::

        TorchEstimator(..., callbacks=[RankProbe("/tmp/probe", "fsdp")])
    """

    def __init__(self, out_dir: str, tag: str, interval: float = 0.01) -> None:
        self.out_dir, self.tag, self.interval = out_dir, tag, interval

    # sampling ---------------------------------------------------------------------------------
    def _sample(self) -> int:
        rss = self._process.memory_info().rss
        phase = self._phase
        if rss > self._peaks.get(phase, 0):
            self._peaks[phase] = rss
        return rss

    def _sampler(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    # hooks ------------------------------------------------------------------------------------
    def _before_forward(self, module: Any, args: Any) -> None:
        if not module.training:
            return
        if self._phase != "steps":  # first forward of an epoch: its clock starts
            self._phase = "steps"
            self._epoch_start = time.perf_counter()
            self._rows = 0
        self._rows += int(args[0].shape[0]) if args and hasattr(args[0], "shape") else 0

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps += 1
        self._step_ends.append(time.perf_counter())
        if self._steps > 1:
            return
        # The first step has created the optimizer state (Adam: exp_avg, exp_avg_sq, step).
        import torch

        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        self._record["first_step"] = {
            "optimizer_class": type(optimizer).__name__,
            "optimizer_param_bytes": sum(_local_bytes(p) for p in params),
            "optimizer_sharded": any(hasattr(p, "to_local") for p in params),
            "optimizer_state_bytes": sum(_local_bytes(v) for v in state),
            "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "rss": self._sample(),
        }

    # the callback protocol --------------------------------------------------------------------
    def on_train_begin(self, model: Any, history: Dict[str, List[float]]) -> None:
        import resource
        import threading

        import psutil
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._process = psutil.Process()
        self._peaks: Dict[str, int] = {}
        self._phase = "begin"
        self._steps = self._rows = 0
        self._step_ends: List[float] = []
        self._epoch_start = time.perf_counter()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        held = sum(_local_bytes(p) for p in model.parameters())
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        self._record: Dict[str, Any] = {
            "tag": self.tag, "rank": rank, "pid": os.getpid(),
            "threads": torch.get_num_threads(), "param_bytes": held,
            "param_bytes_full": total, "rss_begin": self._process.memory_info().rss,
            "maxrss_begin": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "epochs": []}
        self._handles = [register_optimizer_step_post_hook(self._after_step),
                         model.register_forward_pre_hook(self._before_forward)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sampler, name="rank-probe", daemon=True)
        self._thread.start()

    def on_epoch_end(self, epoch: int, logs: Dict[str, float]) -> None:
        seconds = time.perf_counter() - self._epoch_start
        self._sample()
        ends, self._step_ends = self._step_ends, []
        self._record["epochs"].append({
            "epoch": epoch, "seconds": seconds, "rows": self._rows, "steps": self._steps,
            "step_seconds": [b - a for a, b in zip(ends, ends[1:], strict=False)],
            "peak_rss_steps": self._peaks.pop("steps", 0), "loss": logs.get("loss")})
        self._phase = "epoch_end"  # metrics all-reduce, checkpoint (rank 0), next epoch's setup

    def on_train_end(self, model: Any) -> None:
        import resource

        self._stop.set()
        self._thread.join()
        for handle in self._handles:
            handle.remove()
        epochs = self._record["epochs"]
        self._record.update(
            rss_end=self._process.memory_info().rss,
            peak_rss_steps=max(e["peak_rss_steps"] for e in epochs),
            peak_rss_epoch_end=self._peaks.get("epoch_end", 0),
            maxrss_end=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"{self.tag}-rank{self._record['rank']}.json")
        with open(path + ".part", "w") as f:
            json.dump(self._record, f)
        os.replace(path + ".part", path)



# -- driver side --------------------------------------------------------------------------------
def make_model(features: int, hidden: int, layers: int, classes: int, seed: int):
    """``features -> hidden (x layers) -> classes`` MLP; each hidden layer a
    ``Sequential(Linear, ReLU)`` block (what ``activation_checkpointing`` recomputes)."""
    import torch

    torch.manual_seed(seed)
    widths = [features] + [hidden] * layers
    blocks = [torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU())
              for a, b in zip(widths, widths[1:], strict=False)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, classes))


def make_data(spark, rows: int, features: int, classes: int, seed: int):
    """Seeded uniform features (array<float>) and a label in [0, classes): learnable enough
    for a loss to move, which is all this needs."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    x = rng.random((rows, features), dtype=np.float32)
    y = (x[:, : classes].argmax(axis=1)).astype(np.int32)
    pdf = pd.DataFrame({"features": list(x), "label": y})
    return spark.createDataFrame(pdf, "features array<float>, label int").repartition(2).cache()


def run_fit(spark, args, df, store: str, probe_dir: str, tag: str, strategy: str,
            hangs: List[Dict[str, Any]], **extra: Any) -> Dict[str, Any]:
    import torch

    from sparktrain import TorchEstimator

    net = make_model(args.features, args.hidden, args.layers, args.classes, args.seed)
    estimator = TorchEstimator(
        num_proc=2, backend="torch", strategy=strategy, model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=1e-4),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
        batch_size=args.batch_size, epochs=args.epochs, shuffle=True, random_seed=args.seed,
        verbose=0, store=store, callbacks=[RankProbe(probe_dir, tag)], **extra)
    del net
    progress(f"{tag}: fit ({strategy}{', ' + str(extra) if extra else ''})")
    seconds, model = guarded(spark, lambda: estimator.fit(df), args.fit_timeout, f"{tag}: fit",
                             hangs)
    ranks = []
    for rank in range(2):
        with open(os.path.join(probe_dir, f"{tag}-rank{rank}.json")) as f:
            ranks.append(json.load(f))
    loss = model.getHistory()["loss"]
    progress(f"{tag}: fit {seconds:.1f}s, loss {' -> '.join(f'{v:.4f}' for v in loss)}")
    return {"tag": tag, "strategy": strategy, "options": {k: str(v) for k, v in extra.items()},
            "fit_seconds": seconds, "loss": loss, "ranks": ranks}


def rank_row(r: Dict[str, Any]) -> Dict[str, float]:
    """One rank's figures (MiB, samples/s of its last epoch)."""
    step = r.get("first_step", {})
    last = r["epochs"][-1]
    steps = sorted(t for e in r["epochs"] for t in e["step_seconds"])
    median = steps[len(steps) // 2] if steps else 0.0
    batch = sum(e["rows"] for e in r["epochs"]) / max(1, r["epochs"][-1]["steps"])
    return {"rank": r["rank"], "params": r["param_bytes"] / MIB,
            "optimizer": step.get("optimizer_state_bytes", 0) / MIB,
            "grads": step.get("grad_bytes", 0) / MIB,
            "state": (r["param_bytes"] + step.get("optimizer_state_bytes", 0)) / MIB,
            "rss_begin": r["rss_begin"] / MIB, "peak_steps": r["peak_rss_steps"] / MIB,
            "peak_epoch_end": r["peak_rss_epoch_end"] / MIB, "maxrss": r["maxrss_end"] / MIB,
            "samples_s": last["rows"] / last["seconds"] if last["seconds"] else 0.0,
            "samples_s_median": batch / median if median else 0.0,
            "step_s": median, "epoch_s": last["seconds"]}


COLUMNS = [("rank", "rank", "{:.0f}"), ("params", "params MiB", "{:.1f}"),
           ("optimizer", "optimizer MiB", "{:.1f}"), ("grads", "grads MiB", "{:.1f}"),
           ("state", "params+opt MiB", "{:.1f}"), ("rss_begin", "RSS at begin MiB", "{:.0f}"),
           ("peak_steps", "peak RSS steps MiB", "{:.0f}"),
           ("peak_epoch_end", "peak RSS epoch end MiB", "{:.0f}"),
           ("maxrss", "ru_maxrss MiB", "{:.0f}"),
           ("samples_s", "samples/s (last epoch)", "{:.1f}"),
           ("step_s", "median step s", "{:.2f}"),
           ("samples_s_median", "samples/s (median step)", "{:.1f}")]


def markdown_table(run: Dict[str, Any]) -> List[str]:
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for r in run["ranks"]:
        row = rank_row(r)
        lines.append("| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |")
    return lines


def summary(run: Dict[str, Any]) -> Dict[str, float]:
    rows = [rank_row(r) for r in run["ranks"]]
    first = max(r["epochs"][0]["peak_rss_steps"] for r in run["ranks"]) / MIB
    return {"state": max(r["state"] for r in rows),
            "peak_steps": max(r["peak_steps"] for r in rows),
            "peak_steps_first": first,
            "peak_epoch_end": max(r["peak_epoch_end"] for r in rows),
            "maxrss": max(r["maxrss"] for r in rows),
            "rss_begin": max(r["rss_begin"] for r in rows),
            "samples_s": sum(r["samples_s"] for r in rows),
            "samples_s_median": sum(r["samples_s_median"] for r in rows),
            "fit_s": run["fit_seconds"]}


RATIOS = [("state", "params + optimizer state per rank (max of ranks)"),
          ("peak_steps", "peak RSS during training steps (max of ranks)"),
          ("peak_steps_first", "peak RSS during the first epoch's steps, before any checkpoint"),
          ("peak_epoch_end", "peak RSS at epoch ends (checkpoint on rank 0) (max of ranks)"),
          ("maxrss", "ru_maxrss at train end (max of ranks)"),
          ("rss_begin", "RSS at on_train_begin (max of ranks)"),
          ("samples_s", "samples/s, both ranks, last epoch"),
          ("samples_s_median", "samples/s, both ranks, from the median step time"),
          ("fit_s", "fit wall time (driver)")]


def ratio_lines(runs: Dict[str, Dict[str, Any]]) -> List[str]:
    base = summary(runs["ddp"])
    others = [t for t in runs if t != "ddp"]
    lines = ["| figure | ddp | " + " | ".join(others) + " | "
             + " | ".join(f"{t}/ddp" for t in others) + " |",
             "|---|---|" + "---|" * (2 * len(others))]
    for key, title in RATIOS:
        values = [summary(runs[t])[key] for t in others]
        lines.append(f"| {title} | {base[key]:,.1f} | "
                     + " | ".join(f"{v:,.1f}" for v in values) + " | "
                     + " | ".join(f"{v / base[key]:.2f}x" if base[key] else "n/a" for v in values)
                     + " |")
    return lines


RSS_NOTE = (
    "RSS is the whole rank process: interpreter, torch and pyarrow libraries, the Arrow reader, "
    "the pickled payload while it is unpickled (model + optimizer, read from the store), "
    "the model as unpickled (whole on every rank: under "
    "fsdp it is sharded after unpickling, so ru_maxrss includes one full copy), DDP's gradient "
    "buckets (a second copy of the gradients; gradient_as_bucket_view is off), FSDP's "
    "all-gathered block and reduce-scatter buffers, activations, and memory glibc keeps after "
    "a free. 'Epoch end' is the all-reduce of the metrics and rank 0's checkpoint "
    "(full_state: under fsdp rank 0 all-gathers the full model and optimizer state, then "
    "torch.save's bytes).")


def main(argv: Optional[List[str]] = None) -> int:
    parser = new_parser(__doc__)
    parser.add_argument("--rows", type=int, default=320, help="training rows (both ranks)")
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4, help="hidden layers")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (the last one is timed)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="also one fsdp fit with activation_checkpointing on the blocks")
    add_common_args(parser, FIGURES, "bench_fsdp.json", fit_timeout=600.0)
    args = parse_common(parser, argv, FIGURES)
    warnings.filterwarnings("ignore", category=FutureWarning)

    hangs: List[Dict[str, Any]] = []
    runs: Dict[str, Dict[str, Any]] = {}
    # every fit's ranks in fresh Python workers: a reused one would carry the previous fit's RSS
    # high-water mark and whatever its allocator kept
    with local_session(args, "sparktrain-bench-fsdp", "sparktrain-bench-fsdp-",
                       {"spark.python.worker.reuse": "false"}) as (spark, tmp):
        probe_dir, store = os.path.join(tmp, "probe"), os.path.join(tmp, "store")
        load_before = os.getloadavg()
        start = time.perf_counter()
        df = make_data(spark, args.rows, args.features, args.classes, args.seed)
        progress(f"data: {df.count()} rows x {args.features} floats, {args.classes} classes")
        plan = [("ddp", "ddp", {}), ("fsdp", "fsdp", {})]
        if args.activation_checkpointing:
            import torch

            plan.append(("fsdp+ckpt", "fsdp",
                         {"activation_checkpointing": [torch.nn.Sequential]}))
        for tag, strategy, extra in plan:
            runs[tag] = run_fit(spark, args, df, store, probe_dir, tag, strategy, hangs, **extra)
        df.unpersist()
    total = time.perf_counter() - start

    ddp, fsdp = summary(runs["ddp"]), summary(runs["fsdp"])
    params = sum(p.numel() for p in make_model(args.features, args.hidden, args.layers,
                                               args.classes, args.seed).parameters())
    measure = (f"{params / 1e6:.1f}M-param MLP, Adam, 2 ranks on {args.master}, batch "
               f"{args.batch_size}/rank, {args.rows} rows, {args.epochs} epochs")
    speed = {"samples/s ddp": {"value": ddp["samples_s"], "unit": "samples/s"},
             "samples/s fsdp": {"value": fsdp["samples_s"], "unit": "samples/s",
                                "note": f"{fsdp['samples_s'] / ddp['samples_s']:.2f}x ddp"},
             "samples/s from the median step, ddp": {"value": ddp["samples_s_median"],
                                                     "unit": "samples/s"},
             "samples/s from the median step, fsdp": {
                 "value": fsdp["samples_s_median"], "unit": "samples/s",
                 "note": f"{fsdp['samples_s_median'] / ddp['samples_s_median']:.2f}x ddp"}}
    results = [
        figure("state", f"MiB of parameters + optimizer state per rank (max of ranks), {measure}"
               "; ratio = fsdp / ddp", "MiB", fsdp["state"], ddp["state"], "strategy='ddp'",
               fsdp["state"] / ddp["state"], STATE_TARGET, "<=",
               {**speed, **hang_extras(hangs, "")}),
        figure("rss", f"peak RSS per rank while training steps run (max of ranks), {measure}"
               "; ratio = fsdp / ddp", "MiB", fsdp["peak_steps"], ddp["peak_steps"],
               "strategy='ddp'", fsdp["peak_steps"] / ddp["peak_steps"], RSS_TARGET, "<=",
               {"first epoch's steps only (no checkpoint held yet)": {
                    "value": fsdp["peak_steps_first"],
                    "note": f"ddp {ddp['peak_steps_first']:.0f} MiB, "
                            f"{fsdp['peak_steps_first'] / ddp['peak_steps_first']:.2f}x"},
                "ru_maxrss (whole process life)": {
                    "value": fsdp["maxrss"], "note": f"ddp {ddp['maxrss']:.0f} MiB, "
                                                     f"{fsdp['maxrss'] / ddp['maxrss']:.2f}x"},
                "peak RSS at epoch ends (checkpoint)": {
                    "value": fsdp["peak_epoch_end"],
                    "note": f"ddp {ddp['peak_epoch_end']:.0f} MiB, "
                            f"{fsdp['peak_epoch_end'] / ddp['peak_epoch_end']:.2f}x"}}),
    ]
    results[0]["extras"]["runs"] = runs

    md = [f"# bench_fsdp: {measure}", "", f"{load_note(load_before)}, bench {total:.0f} s", ""]
    for tag, run in runs.items():
        md += [f"## {tag} (fit {run['fit_seconds']:.1f} s, loss "
               f"{' -> '.join(f'{v:.4f}' for v in run['loss'])})", ""] + markdown_table(run) + [""]
    md += ["## ratios", ""] + ratio_lines(runs) + ["", RSS_NOTE, ""]
    report(results, args.json_out, lambda: {
        **arg_meta(args, "rows", "features", "hidden", "layers", "classes"), "params": params,
        **arg_meta(args, "batch_size", "epochs", "master"),
        "activation_checkpointing_run": args.activation_checkpointing, "bench_seconds": total,
        "rss_note": RSS_NOTE, **load_meta(load_before), **versions()}, "\n".join(md))
    if args.json_out:
        md_path = os.path.splitext(args.json_out)[0] + ".md"
        with open(md_path, "w") as f:
            f.write("\n".join(md))
        progress(f"wrote {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
