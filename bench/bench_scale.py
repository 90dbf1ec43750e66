#!/usr/bin/env python
"""How each cost of a fit grows with the data: Parquet tables of 1M to 64M rows x 32 float32,
a 2-rank TorchEstimator fit in both input modes (issue #44).

    .venv/bin/python bench/bench_scale.py                          # 1M, 4M, 16M, 64M rows
    .venv/bin/python bench/bench_scale.py --rows 1M,4M             # a short run (~5 min here)
    .venv/bin/python bench/bench_scale.py --rows 16M --modes stream --scratch /mnt/tmpfs
    .venv/bin/python bench/bench_scale.py --rows 1M,16M --starts cold,warm  # issue #50's

The tables are generated once by pyarrow under --data (files of --rows-per-file rows, row groups
of --row-group-rows, snappy: a data lake's table; ``features`` array<float> x 32, ``label``
int64 0/1, linearly separable) and reused by later runs. Every (rows, mode) then runs in a fresh
Python process of its own (memory peaks do not mix): a ``local[4]`` session (2 ranks and 2 free
task slots, as GPU machines have more cores than GPUs) whose SPARK_LOCAL_DIRS, TMPDIR and
java.io.tmpdir are folders under --scratch, for a *warm* start a 1-epoch warm-up fit on 32K
rows (so the figures are not the session's cold start), for a *cold* one none (the measured
fit is the process's first, as the first fit of a ``spark-submit`` job; --starts picks, both
by default, each in its own process), then the measured fit: the MLP 32-64-2, SGD
lr 0.1, batch 1,024 a rank, shuffled, --epochs epochs, on ``spark.read.parquet`` of the table.

Per fit, in the wall clock of the machine:
  first step     fit() called -> the later of the 2 ranks' first loss computation (the loss
                 module marks its first call in each rank process)
  session        the Spark session's own start in that process (local_spark() returning):
                 a cold start's target is first step <= 2 x the warm one + this
  before it      preflight (fit() -> the run named) | data (-> the ranks' stage submitted:
                 store: materialized; stream: the plan) | launch (-> the payload unpickled in
                 both ranks) | readers (-> on_train_begin: the rank's readers, process group and
                 model set up; stream: the rows spooled) | first batch (-> the first loss)
  epochs         each epoch's seconds (on_epoch_end marks; the first from the first step)
  fit            fit() called -> the model back
  peak disk      bytes under SPARK_LOCAL_DIRS and the temp dir (sampled every --interval s),
                 peak above the fit's start; also with the store's bytes (store mode writes
                 the dataset there)
  peak anon      RssAnon summed over the process tree (this process, the JVM, Python workers,
                 ranks), sampled likewise; also at the fit's start
  store          bytes in the store after the fit (the dataset, checkpoints, weights)

Prints progress to stderr, a markdown table (rows x mode) and issue #44's targets to stdout,
writes everything (with the sampled series) to --out (bench/results/bench_scale.json) and draws
--png (bench/scale.png: first step, epoch seconds, peak disk / decoded bytes, peak anon memory,
each against rows on a log axis, one line per mode).
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from common import (
    HERE,
    bytes_under,
    load_meta,
    load_note,
    new_parser,
    progress,
    quiet_warnings,
    versions,
)

from sparktrain.loop.callbacks import Callback

MODES = ("store", "stream")
FEATURES = 32
BATCH = 1024
ROW_BYTES = FEATURES * 4 + 8  # decoded: float32 features + int64 label
WARMUP_ROWS = 32 * BATCH
Record = Dict[str, Any]
#: the sampled series' columns (seconds since the fit's start, then bytes)
SERIES = ("seconds", "anon", "pss_anon", "rss", "scratch", "scratch_apparent", "store")


# -- marks, written by the ranks (shipped by value: must live in this script) --------------------
def mark(path: str, what: str, **more: Any) -> None:
    """Append ``{pid, what, t}`` (wall clock) to the marks file ``path``, one JSON line."""
    line = json.dumps({"pid": os.getpid(), "what": what, "t": time.time(), **more})
    with open(path, "a") as f:
        f.write(line + "\n")


class EpochMarks(Callback):
    """Marks each rank's ``on_train_begin`` and every ``on_epoch_end``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_begin(self, model: Any, history: Dict[str, List[float]]) -> None:
        mark(self.path, "train_begin")

    def on_epoch_end(self, epoch: int, logs: Dict[str, float]) -> None:
        mark(self.path, "epoch_end", epoch=epoch)


def marked_loss(path: str) -> Any:
    """``CrossEntropyLoss`` marking, in every process, when it is unpickled (a rank has its
    payload) and its first call (the first training step)."""
    import torch

    class FirstStepLoss(torch.nn.CrossEntropyLoss):
        def __init__(self, path: str) -> None:
            super().__init__()
            self.path, self.seen = path, None

        def __setstate__(self, state: Dict[str, Any]) -> None:
            super().__setstate__(state)
            mark(self.path, "loaded")

        def forward(self, output: Any, target: Any) -> Any:
            if self.seen != os.getpid():  # the driver's preflight called it before shipping
                self.seen = os.getpid()
                mark(self.path, "first_step")
            return super().forward(output, target)

    return FirstStepLoss(path)


# -- the data -----------------------------------------------------------------------------------
def parse_rows(text: str) -> int:
    """``"1M"`` -> 1,000,000; ``"500K"``, ``"1_000_000"`` and plain numbers too."""
    text = text.strip().upper().replace("_", "").replace(",", "")
    scale = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def label(rows: int) -> str:
    for unit, size in (("G", 10 ** 9), ("M", 10 ** 6), ("K", 10 ** 3)):
        if rows % size == 0:
            return f"{rows // size}{unit}"
    return f"{rows:,}"


def ensure_table(root: str, rows: int, rows_per_file: int, group_rows: int, seed: int) -> str:
    """The Parquet table of ``rows`` rows under ``root`` (written by pyarrow, once: a complete
    one with the same layout is reused); its folder."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = os.path.join(root, f"rows-{label(rows)}")
    layout = {"rows": rows, "rows_per_file": rows_per_file, "row_group_rows": group_rows,
              "seed": seed, "features": FEATURES, "version": 1}
    done = os.path.join(folder, "_bench_scale.json")
    if os.path.exists(done):
        with open(done) as f:
            if json.load(f) == layout:
                progress(f"reusing the {label(rows)}-row table in {folder}")
                return folder
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    progress(f"writing the {label(rows)}-row table to {folder} "
             f"({rows * ROW_BYTES / 2 ** 30:.2f} GiB decoded)")
    start, signs = time.perf_counter(), np.where(np.arange(FEATURES) % 2 == 0, 1.0, -1.0)
    for index, first in enumerate(range(0, rows, rows_per_file)):
        count = min(rows_per_file, rows - first)
        values = np.random.default_rng([seed, index]).random((count, FEATURES), np.float32)
        labels = (values @ signs > 0).astype(np.int64)
        features = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), FEATURES)
        table = pa.table({"features": features.cast(pa.list_(pa.float32())),
                          "label": pa.array(labels)})
        pq.write_table(table, os.path.join(partial, f"part-{index:05d}.snappy.parquet"),
                       row_group_size=group_rows, compression="snappy")
    with open(os.path.join(partial, "_bench_scale.json"), "w") as f:
        json.dump(layout, f)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(partial, folder)
    progress(f"wrote {label(rows)} rows in {time.perf_counter() - start:.1f}s, "
             f"{bytes_under(folder) / 2 ** 30:.2f} GiB on disk")
    return folder


# -- measuring one fit (in the child process) ------------------------------------------------------
def tree_memory() -> Dict[str, Any]:
    """Bytes summed over this process and all its descendants: ``anon`` (RssAnon), ``rss``
    (VmRSS) and ``pss_anon`` (Pss_Anon: anonymous pages shared copy-on-write after a fork, as a
    forked Python worker shares its daemon's, are split between the sharers instead of counted
    in each)."""
    import psutil

    root, anon, rss, pss_anon, pids = psutil.Process(), 0, 0, 0, {}
    for proc in [root] + root.children(recursive=True):
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                status = f.read()
            with open(f"/proc/{proc.pid}/smaps_rollup") as f:
                rollup = f.read()
        except OSError:
            continue
        found = dict(re.findall(r"^(RssAnon|VmRSS):\s+(\d+) kB", status, re.M))
        anon += int(found.get("RssAnon", 0)) * 1024
        rss += int(found.get("VmRSS", 0)) * 1024
        pss = re.search(r"^Pss_Anon:\s+(\d+) kB", rollup, re.M)
        pss_anon += int(pss.group(1)) * 1024 if pss else 0
        pids[proc.pid] = int(found.get("RssAnon", 0)) * 1024
    return {"anon": anon, "pss_anon": pss_anon, "rss": rss, "procs": len(pids), "pids": pids}


def process_name(pid: int) -> str:
    """A short name for a process of the tree: its command line's first words."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return "?"
    words = [os.path.basename(w.decode(errors="replace")) if i == 0 else w.decode(
        errors="replace") for i, w in enumerate(words[:4]) if w]
    return "java (the Spark JVM)" if words and words[0] == "java" else " ".join(words)[:100]


def disk_bytes(*paths: str) -> Dict[str, int]:
    """Bytes on disk under ``paths``: ``allocated`` (the blocks files hold: a sparse or
    preallocated file counts what was written) and ``apparent`` (their sizes)."""
    allocated = apparent = 0
    for path in paths:
        for folder, _, files in os.walk(path):
            for name in files:
                try:
                    st = os.stat(os.path.join(folder, name))
                except OSError:  # gone meanwhile
                    continue
                allocated += st.st_blocks * 512
                apparent += st.st_size
    return {"allocated": allocated, "apparent": apparent}


class Sampler:
    """While the block runs, a thread samples every ``interval`` s the process tree's memory, the
    bytes under ``scratch`` (local dirs, temp dir; allocated, and apparent as
    ``scratch_apparent``) and under ``store``: their peaks, the values at the start (``start``)
    and the series (:data:`SERIES` columns)."""

    def __init__(self, scratch: Sequence[str], store: str, interval: float) -> None:
        self.scratch, self.store, self.interval = list(scratch), store, interval
        self.peak: Dict[str, int] = collections.defaultdict(int)
        self.start: Dict[str, int] = {}
        self.series: List[List[float]] = []
        self.by_process: Dict[int, Dict[str, Any]] = {}  # every process seen in the tree
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scale-sampler", daemon=True)
        self._t0 = time.time()

    def sample(self) -> Dict[str, int]:
        scratch = disk_bytes(*self.scratch)
        now = {**tree_memory(), "scratch": scratch["allocated"],
               "scratch_apparent": scratch["apparent"],
               "store": disk_bytes(self.store)["allocated"]}
        for pid, value in now.pop("pids").items():  # each process's own RssAnon peak
            if pid not in self.by_process:
                self.by_process[pid] = {"name": process_name(pid), "anon_peak": 0}
            self.by_process[pid]["anon_peak"] = max(self.by_process[pid]["anon_peak"], value)
        now["disk"] = now["scratch"] + now["store"]
        for key, value in now.items():
            self.peak[key] = max(self.peak[key], value)
        self.series.append([round(time.time() - self._t0, 2)] + [now[k] for k in SERIES[1:]])
        return now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "Sampler":
        self._t0 = time.time()
        self.start = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class FitLog(logging.Handler):
    """sparktrain's driver log lines of one fit, with their time since ``t0``."""

    def __init__(self) -> None:
        super().__init__()
        self.t0, self.lines = time.time(), []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append([round(time.time() - self.t0, 3), record.getMessage()[:400]])

    def find(self, pattern: str) -> List[re.Match]:
        return [m for m in (re.search(pattern, line) for _, line in self.lines) if m]


def make_estimator(store: str, marks: str, mode: str, epochs: int) -> Any:
    import torch
    from bench_torch import make_mlp

    from sparktrain import TorchEstimator

    torch.manual_seed(0)
    net = make_mlp(FEATURES)
    return TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(),
                                                                           lr=0.1),
                          loss=marked_loss(marks), callbacks=[EpochMarks(marks)],
                          feature_cols=["features"], label_cols=["label"], batch_size=BATCH,
                          epochs=epochs, shuffle=True, random_seed=0, verbose=1, store=store,
                          input_mode=mode)


def timeline(marks_path: str, driver: Dict[str, float], t_call: float,
             t_done: float) -> Record:
    """Seconds of each phase from the driver's marks and the ranks' (the later rank's)."""
    with open(marks_path) as f:
        marks = [json.loads(line) for line in f if line.strip()]
    marks = [m for m in marks if m["pid"] != os.getpid()]  # the driver's preflight and copies
    pids = {m["pid"] for m in marks if m["what"] == "epoch_end"} or \
        {m["pid"] for m in marks if m["what"] == "first_step"}

    def latest(what: str, mine: bool = True) -> Optional[float]:
        times = [m["t"] for m in marks if m["what"] == what and (not mine or m["pid"] in pids)]
        return max(times) if times else None

    loaded = latest("loaded") or latest("loaded", mine=False)
    begin, first = latest("train_begin"), latest("first_step")
    ends = sorted({m["epoch"] for m in marks if m["what"] == "epoch_end"})
    end_times = [max(m["t"] for m in marks if m["what"] == "epoch_end" and m["epoch"] == e
                     and m["pid"] in pids) for e in ends]
    started, launch = driver.get("started"), driver.get("launch")
    out: Record = {"first_step": None if first is None else first - t_call,
                   "fit": t_done - t_call, "rank_pids": sorted(pids)}
    points = [("preflight", started), ("data", launch), ("launch", loaded),
              ("readers", begin), ("first_batch", first)]
    before, last = {}, t_call
    for name, t in points:
        if t is not None:
            before[name], last = t - last, t
    out["before_first_step"] = before
    out["epochs"] = [b - a for a, b in zip([first] + end_times[:-1], end_times, strict=True)] \
        if first is not None else []
    out["after_epochs"] = t_done - end_times[-1] if end_times else None
    return out


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Runs in a fresh process (SPARK_LOCAL_DIRS and TMPDIR set by the parent): one session, a
    warm-up fit unless ``cold``, then the measured fit under the sampler."""
    quiet_warnings()
    from sparktrain import local_spark
    from sparktrain.fit_hooks import FitListener, register_fit_hook

    work, mode = spec["work"], spec["mode"]
    scratch = [os.environ["SPARK_LOCAL_DIRS"], os.environ["TMPDIR"]]
    started = time.perf_counter()
    spark = local_spark(spec["master"], "sparktrain-bench-scale", conf={
        "spark.driver.memory": spec["driver_memory"], "spark.ui.enabled": "false",
        "spark.local.dir": os.environ["SPARK_LOCAL_DIRS"],
        "spark.driver.extraJavaOptions": f"-Djava.io.tmpdir={os.environ['TMPDIR']}"})
    session_seconds = time.perf_counter() - started
    driver: Dict[str, float] = {}

    class Listener(FitListener):
        def started(self, *args: Any) -> None:
            driver.setdefault("started", time.time())

        def on_progress(self, event: Dict[str, Any]) -> None:
            if event.get("event") == "start":
                driver.setdefault("start_event", time.time())

    register_fit_hook("bench-scale", lambda estimator: _yielding(Listener()))
    fit_log = FitLog()
    logger = logging.getLogger("sparktrain")
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(logging.Formatter("[sparktrain] %(message)s"))
    for handler in (fit_log, to_stderr):
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        df = spark.read.parquet("file://" + spec["table"])
        partitions = df.rdd.getNumPartitions()
        if not spec["cold"]:
            t = time.perf_counter()
            est = make_estimator(os.path.join(work, "warmup-store"),
                                 os.path.join(work, "warmup-marks.jsonl"), mode, 1)
            est.fit(df.limit(WARMUP_ROWS))
            shutil.rmtree(os.path.join(work, "warmup-store"), ignore_errors=True)
            progress(f"warm-up fit ({WARMUP_ROWS:,} rows, 1 epoch): "
                     f"{time.perf_counter() - t:.1f}s")
        store, marks = os.path.join(work, "store"), os.path.join(work, "marks.jsonl")
        est = make_estimator(store, marks, mode, spec["epochs"])
        if hasattr(est, "_train"):  # marks the end of the data step (private: may go)
            train = est._train

            def marked_train(run: Any) -> Any:
                driver.setdefault("launch", time.time())
                return train(run)
            est._train = marked_train
        driver.clear()
        fit_log.lines.clear()
        with Sampler(scratch, store, spec["interval"]) as peaks:
            t_call = fit_log.t0 = time.time()
            model = est.fit(df)
            t_done = time.time()
        history = model.getHistory()
        materialize = fit_log.find(r"^fit done in [\d.]+s \(materialize ([\d.]+)s")
        if "launch" not in driver and "started" in driver and materialize:
            driver["launch"] = driver["started"] + float(materialize[-1].group(1))
        out = timeline(marks, driver, t_call, t_done)
        epoch_lines = fit_log.find(r"^\[rank 0\] epoch \d+/\d+ .*\(([\d.]+)s\)$")
        out.update(
            rows=spec["rows"], mode=mode, start=spec["start"], session=session_seconds,
            epochs_logged=[float(m.group(1)) for m in epoch_lines],
            materialize_logged=float(materialize[-1].group(1)) if materialize else None,
            failed_attempts=[line for _, line in fit_log.lines if " failed on attempt " in line],
            start_event=driver["start_event"] - t_call if "start_event" in driver else None,
            loss=history["loss"], input_partitions=partitions,
            ranks_in_tree=set(out["rank_pids"]) <= set(peaks.by_process),
            by_process=sorted(({"pid": pid, **v} for pid, v in peaks.by_process.items()),
                              key=lambda p: -p["anon_peak"]),
            peak={k: v for k, v in peaks.peak.items()},
            at_start={k: v for k, v in peaks.start.items()},
            peak_scratch_above_start=peaks.peak["scratch"] - peaks.start["scratch"],
            peak_disk_above_start=peaks.peak["disk"] - peaks.start["disk"],
            store_bytes=bytes_under(store),
            dataset_bytes=bytes_under(os.path.join(store, "datasets")),
            series=peaks.series, log=fit_log.lines)
        return out
    finally:
        for handler in (fit_log, to_stderr):
            logger.removeHandler(handler)
        spark.stop()


def _yielding(listener: Any) -> Any:
    """A context manager yielding ``listener`` (a fit hook)."""
    from contextlib import contextmanager

    @contextmanager
    def hook() -> Any:
        yield listener
    return hook()


def run_fit(args: argparse.Namespace, rows: int, mode: str, table: str, start: str) -> Record:
    """One (rows, mode, start) in a fresh process; its record, or ``{"error": ...}`` with the
    output's tail verbatim."""
    work = os.path.join(args.scratch, f"{label(rows)}-{mode}-{start}")
    shutil.rmtree(work, ignore_errors=True)
    local, tmp = os.path.join(work, "spark-local"), os.path.join(work, "tmp")
    os.makedirs(local)
    os.makedirs(tmp)
    result = os.path.join(work, "result.json")
    spec = {"rows": rows, "mode": mode, "table": table, "work": work, "master": args.master,
            "epochs": args.epochs, "cold": start == "cold", "start": start,
            "interval": args.interval,
            "driver_memory": args.driver_memory, "result": result}
    env = {**os.environ, "SPARK_LOCAL_DIRS": local, "TMPDIR": tmp}
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                             json.dumps(spec)], env=env, cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tail: collections.deque = collections.deque(maxlen=60)

    def tee() -> None:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if not args.quiet:
                sys.stderr.write(f"    | {line}")
    reader = threading.Thread(target=tee, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=args.fit_timeout)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)  # the child's own session: its JVM, workers, ranks
                proc.wait(timeout=wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
    reader.join(timeout=10)
    try:
        if proc.returncode == 0 and os.path.exists(result):
            with open(result) as f:
                return json.load(f)
        why = "timed out" if proc.returncode is None or proc.returncode < 0 else \
            f"exit code {proc.returncode}"
        return {"rows": rows, "mode": mode, "start": start,
                "error": f"{why}:\n" + "\n".join(tail)}
    finally:
        if args.keep_tmp:
            progress(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


# -- results ------------------------------------------------------------------------------------
def gib(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:,.0f} MiB"


def secs(s: Optional[float]) -> str:
    return "n/a" if s is None else f"{s:.1f} s"


PHASES = (("preflight", "preflight"), ("data", "data"), ("launch", "launch"),
          ("readers", "readers"), ("first_batch", "first batch"))


def markdown(records: List[Record]) -> str:
    head = ("| rows (decoded) | mode | start (session s) | first step | epochs | whole fit | "
            "peak local disk (/ decoded) | + store | store after | anon memory: start → peak | "
            "Pss_Anon peak | before the first step (s) |")
    lines = [head, "|" + "---|" * 12]
    for r in records:
        rows = f"{label(r['rows'])} ({gib(r['rows'] * ROW_BYTES)})"
        start = r.get("start", "warm")
        if "error" in r:
            lines.append(f"| {rows} | {r['mode']} | {start} | FAILED (below) |" + " |" * 8)
            continue
        start = f"{start} ({r['session']:.1f})" if r.get("session") is not None else start
        decoded = r["rows"] * ROW_BYTES
        disk = r["peak_scratch_above_start"]
        before = ", ".join(f"{name} {r['before_first_step'][key]:.1f}" for key, name in PHASES
                           if key in r["before_first_step"])
        lines.append(
            f"| {rows} | {r['mode']} | {start} | **{secs(r['first_step'])}** | "
            f"{' + '.join(f'{s:.1f}' for s in r['epochs'])} s | {secs(r['fit'])} | "
            f"{gib(disk)} ({disk / decoded:.2f}×) | {gib(r['peak_disk_above_start'])} | "
            f"{gib(r['store_bytes'])} | {gib(r['at_start']['anon'])} → "
            f"**{gib(r['peak']['anon'])}** | {gib(r['peak']['pss_anon'])} | {before} |")
    return "\n".join(lines)


def targets(records: List[Record]) -> List[Record]:
    """Issue #44's done-when figures, between the smallest size of each mode and 16M rows (the
    issue's sizes), or the largest run where there is no 16M one (warm starts); issue #50's:
    a cold first step against the warm one plus the session's start, at each size."""
    out = cold_targets(records)
    for mode in MODES:
        ok = sorted((r for r in records if r["mode"] == mode and "error" not in r
                     and r.get("start", "warm") == "warm"), key=lambda r: r["rows"])
        if len(ok) < 2:
            continue
        at_16m = [r for r in ok if r["rows"] == 16_000_000]
        small, large = ok[0], (at_16m or ok)[-1]
        sizes = f"{label(large['rows'])} / {label(small['rows'])}"
        anon = large["peak"]["anon"] / small["peak"]["anon"]
        pss = large["peak"]["pss_anon"] / small["peak"]["pss_anon"]
        disk = large["peak_scratch_above_start"] / (large["rows"] * ROW_BYTES)
        if mode == "stream" and None not in (large["first_step"], small["first_step"]):
            gap = large["first_step"] - small["first_step"]
            out.append({"figure": f"stream first step {sizes} (difference)", "value": gap,
                        "text": f"+{gap:.1f} s", "target": "≤ 3 s", "met": gap <= 3.0})
            out.append({"figure": f"stream peak local disk / decoded at {label(large['rows'])}",
                        "value": disk, "text": f"{disk:.2f}×", "target": "≤ 1.25×",
                        "met": disk <= 1.25})
        what = "" if mode == "stream" else " (stays flat)"
        out.append({"figure": f"{mode} peak anon memory (RssAnon) {sizes}{what}",
                    "value": anon, "text": f"{anon:.2f}×", "target": "≤ 1.3×",
                    "met": anon <= 1.3})
        out.append({"figure": f"{mode} peak anon memory (Pss_Anon) {sizes}{what}",
                    "value": pss, "text": f"{pss:.2f}×", "target": "≤ 1.3×", "met": pss <= 1.3})
    return out


def cold_targets(records: List[Record]) -> List[Record]:
    """Each (rows, mode) measured both ways: cold first step <= 2 x warm + the session's."""
    out = []
    done = {(r["rows"], r["mode"], r.get("start", "warm")): r for r in records
            if "error" not in r and r.get("first_step") is not None}
    for (rows, mode, start), cold in sorted(done.items()):
        warm = done.get((rows, mode, "warm"))
        if start != "cold" or warm is None:
            continue
        bound = 2 * warm["first_step"] + cold["session"]
        out.append({"figure": f"{mode} cold first step at {label(rows)} (warm "
                              f"{warm['first_step']:.1f} s, session {cold['session']:.1f} s)",
                    "value": cold["first_step"], "text": f"{cold['first_step']:.1f} s",
                    "target": f"≤ 2 × warm + session = {bound:.1f} s",
                    "met": cold["first_step"] <= bound})
    return out


def draw(records: List[Record], path: str, title: str) -> None:
    """Four panels against rows (log x), one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.2))
    panels = [
        (axes[0][0], "first training step after fit() (s)"),
        (axes[0][1], "epoch seconds (solid: epoch 1, dashed: the last)"),
        (axes[1][0], "peak local disk / decoded bytes\n(dashed: with the store)"),
        (axes[1][1], "peak anonymous memory of the process tree (GiB)\n"
                     "(solid: RssAnon, dashed: Pss_Anon, dotted: RssAnon at fit() start)"),
    ]
    colors = {"store": "tab:blue", "stream": "tab:orange"}
    all_rows = sorted({r["rows"] for r in records})
    for mode in MODES:
        cold = sorted((r for r in records if r["mode"] == mode and "error" not in r
                       and r.get("start") == "cold"), key=lambda r: r["rows"])
        if cold:  # the first step of a fresh process's first fit, beside the warm one
            axes[0][0].plot([r["rows"] for r in cold], [r["first_step"] for r in cold],
                            color=colors[mode], marker="s", linestyle=":",
                            label=f"{mode}, cold start")
        ok = sorted((r for r in records if r["mode"] == mode and "error" not in r
                     and r.get("start", "warm") == "warm"), key=lambda r: r["rows"])
        if not ok:
            continue
        x = [r["rows"] for r in ok]
        decoded = [r["rows"] * ROW_BYTES for r in ok]
        kw = {"color": colors[mode], "marker": "o"}
        axes[0][0].plot(x, [r["first_step"] for r in ok], label=mode, **kw)
        axes[0][1].plot(x, [r["epochs"][0] if r["epochs"] else None for r in ok], label=mode,
                        **kw)
        if any(len(r["epochs"]) > 1 for r in ok):
            axes[0][1].plot(x, [r["epochs"][-1] if r["epochs"] else None for r in ok],
                            linestyle="--", **kw)
        axes[1][0].plot(x, [r["peak_scratch_above_start"] / d for r, d in zip(ok, decoded,
                                                                              strict=True)],
                        label=mode, **kw)
        axes[1][0].plot(x, [r["peak_disk_above_start"] / d for r, d in zip(ok, decoded,
                                                                           strict=True)],
                        linestyle="--", **kw)
        axes[1][1].plot(x, [r["peak"]["anon"] / 2 ** 30 for r in ok], label=mode, **kw)
        axes[1][1].plot(x, [r["peak"]["pss_anon"] / 2 ** 30 for r in ok], linestyle="--",
                        **kw)
        axes[1][1].plot(x, [r["at_start"]["anon"] / 2 ** 30 for r in ok], linestyle=":",
                        **kw)
    for ax, what in panels:
        ax.set_xscale("log")
        ax.set_xticks(all_rows, [label(n) for n in all_rows])
        ax.minorticks_off()
        ax.set_title(what, fontsize=9)
        ax.set_xlabel("rows (x 32 float32)", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"drew {path}")


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--rows", default="1M,4M,16M,64M",
                        help="table sizes, comma-separated (1M = 1,000,000 rows)")
    parser.add_argument("--modes", default=",".join(MODES), help="input modes, comma-separated")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--master", default="local[4]",
                        help="Spark master: 2 ranks and free task slots")
    parser.add_argument("--data", default="/tmp/sparktrain-bench-scale/data",
                        help="where the tables are generated once and reused")
    parser.add_argument("--scratch", default="/tmp/sparktrain-bench-scale/run",
                        help="each fit's SPARK_LOCAL_DIRS, TMPDIR and store go in a folder here")
    parser.add_argument("--rows-per-file", type=int, default=500_000)
    parser.add_argument("--row-group-rows", type=int, default=125_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--interval", type=float, default=0.2,
                        help="seconds between samples of memory and disk")
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--starts", default="warm,cold",
                        help="warm (a warm-up fit first), cold (the measured fit is the "
                             "process's first), or both, comma-separated")
    parser.add_argument("--cold", action="store_true", help="the same as --starts cold")
    parser.add_argument("--fit-timeout", type=float, default=3600.0,
                        help="seconds one (rows, mode) process may take (killed after)")
    parser.add_argument("--out", "--json-out", dest="out",
                        default=os.path.join(HERE, "results", "bench_scale.json"))
    parser.add_argument("--png", default=os.path.join(HERE, "scale.png"),
                        help="the figure ('' for none)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the fits' output")
    parser.add_argument("--keep-tmp", action="store_true", help="leave each fit's folder")
    args = parser.parse_args(argv)
    args.rows = sorted({parse_rows(r) for r in args.rows.split(",") if r.strip()})
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.starts = ["cold"] if args.cold else \
        [t.strip() for t in args.starts.split(",") if t.strip()]
    if set(args.starts) - {"warm", "cold"} or not args.starts:
        parser.error("--starts: warm, cold or both")
    if set(args.modes) - set(MODES) or not args.modes:
        parser.error(f"--modes: some of {list(MODES)}")
    if not args.rows or args.rows[0] < WARMUP_ROWS or args.epochs < 1:
        parser.error(f"--rows at least {WARMUP_ROWS:,} each, --epochs at least 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    records: List[Record] = []
    for rows in args.rows:
        table = ensure_table(args.data, rows, args.rows_per_file, args.row_group_rows,
                             args.seed)
        for mode, start in ((m, t) for m in args.modes for t in args.starts):
            progress(f"== {label(rows)} rows, {mode}, {start} start ==")
            r = run_fit(args, rows, mode, table, start)
            records.append(r)
            if "error" in r:
                progress(f"{label(rows)} {mode} {start} FAILED: {r['error'][-2000:]}")
            else:
                progress(f"{label(rows)} {mode} {start}: session {r['session']:.1f}s, first "
                         f"step {r['first_step']:.1f}s, fit "
                         f"{r['fit']:.1f}s, epochs {[round(s, 1) for s in r['epochs']]}, peak "
                         f"disk {gib(r['peak_scratch_above_start'])}, peak anon "
                         f"{gib(r['peak']['anon'])}"
                         + ("" if r["ranks_in_tree"] else "; the ranks were NOT in the tree"))
    title = (f"sparktrain scale: 2 ranks, {args.epochs} epochs, {args.master}, "
             f"{load_note(load_before)}")
    checks = targets(records)
    print()
    print(title)
    print()
    print(markdown(records))
    print()
    for c in checks:
        print(f"- {c['figure']}: {c['text']} (target {c['target']}: "
              f"{'met' if c['met'] else 'NOT met'})")
    for r in (r for r in records if "error" in r):
        print(f"\n{label(r['rows'])} {r['mode']} {r.get('start')} FAILED:\n{r['error']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": {**{k: getattr(args, k) for k in (
            "rows", "modes", "epochs", "master", "data", "scratch", "rows_per_file",
            "row_group_rows", "seed", "interval", "starts", "driver_memory")},
            "batch": BATCH, "row_bytes": ROW_BYTES, "series_columns": SERIES,
            **load_meta(load_before), **versions()},
            "targets": checks, "fits": records}, f, indent=1)
    progress(f"wrote {args.out}")
    if args.png and any("error" not in r for r in records):
        draw(records, args.png, title)
    return 0


def child_main() -> None:
    """``--child JSON``: measure one fit, write its record to the spec's ``result`` file."""
    spec = json.loads(sys.argv[2])
    out = child(spec)
    with open(spec["result"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main()
        sys.exit(0)
    sys.exit(main())
