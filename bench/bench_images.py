#!/usr/bin/env python
"""Benchmark the image path: JPEG bytes from a binaryFile DataFrame, decoded and augmented by a
``transformation_fn`` in sparktrain's decode worker processes, against the alternatives.

    .venv/bin/python bench/bench_images.py                              # 20,000 JPEGs, every figure
    .venv/bin/python bench/bench_images.py --images 1500 --repeats 1    # smoke run
    .venv-spark35/bin/python bench/bench_images.py                      # + the Petastorm figures

The data: ``--images`` 96x96 RGB JPEGs (Pillow, quality 90) drawn from scikit-learn's bundled
digits (upscaled, coloured, on a noisy gradient; no download), written as files, read with
``spark.read.format("binaryFile")`` into ``content`` (binary) and ``label`` (int, from the file
name). The decode function (``decode``, below) is the same everywhere: Pillow decode, a random
88x88 crop, a random horizontal flip, uint8 CHW, stacked to ``(rows, 3, 88, 88)``.

Figures (bench/README.md: method and figures; bench/HISTORY.md: the full write-up):

  workers     images/s delivered to one rank's loop (world size 1, batch --batch-size):
              ShardReader + BatchFeed(reader_pool="process") with 2 decode workers / with 1
              (target >= 1.6x); extra: reader_pool="thread" (decode in the loop), the
              one-core decode ceiling
  dataloader  the same sparktrain loop with 2 workers / a hand-written torch DataLoader
              (IterableDataset over the same Parquet files, batches dealt out to the
              workers, num_workers=2, persistent_workers=True, the same decode per batch in
              its workers) (>= 1.0x)
  petastorm   the same / Petastorm make_spark_converter + make_torch_dataloader(TransformSpec,
              workers_count=2, reader_pool_type="process") (>= 2x; classic stack only)
  rss         peak RSS of the reading process tree (rank + decode workers) per epoch over 10
              epochs, 2 workers, fresh process: peak(epoch 10) / peak(epoch 2) (<= 1.05)
  e2e         seconds from the binaryFile DataFrame to a fitted 2-rank small CNN, 1 epoch:
              TorchDistributor + Petastorm converter / TorchEstimator (>= 2x; the baseline
              needs the classic stack, the sparktrain side runs everywhere)

Prints progress to stderr, then a table and one JSON line per figure to stdout, and writes
everything to --json-out (default bench/results/bench_images.json).
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import pickle
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
from common import (
    add_common_args,
    arg_meta,
    child_entry,
    figure,
    guarded,
    hang_extras,
    load_meta,
    load_note,
    new_parser,
    parse_common,
    progress,
    quiet_warnings,
    remove_tmp,
    report,
    run_child,
    spark_conf,
    timed,
    versions,
)
from PIL import Image

FIGURES = ("workers", "dataloader", "petastorm", "rss", "e2e")
SIDE, CROP, CLASSES, QUALITY = 96, 88, 10, 90
LR = 0.01
RSS_EPOCHS = 10
E2E_WARMUP_IMAGES = 512


# -- the decode function: module level, so cloudpickle sends it by value -------------------------
def decode_images(contents) -> np.ndarray:
    """JPEG bytes -> uint8 ``(rows, 3, CROP, CROP)``: Pillow decode, random crop, random
    horizontal flip (``numpy.random``: sparktrain seeds it per batch in its workers)."""
    out = np.empty((len(contents), 3, CROP, CROP), dtype=np.uint8)
    for row, data in enumerate(contents):
        with Image.open(io.BytesIO(data)) as image:
            pixels = np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
        top = np.random.randint(0, pixels.shape[0] - CROP + 1)
        left = np.random.randint(0, pixels.shape[1] - CROP + 1)
        pixels = pixels[top:top + CROP, left:left + CROP]
        if np.random.random() < 0.5:
            pixels = pixels[:, ::-1]
        out[row] = pixels.transpose(2, 0, 1)
    return out


def decode(batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The ``transformation_fn``: ``{"content": object array of bytes, "label": ints}`` in,
    the same dict with ``content`` replaced by uint8 ``(rows, 3, 88, 88)`` out."""
    return dict(batch, content=decode_images(batch["content"]))


def petastorm_transform(pdf):
    """The same decode as Petastorm's ``TransformSpec`` function: a pandas DataFrame in, with
    ``content`` replaced by one uint8 ``(3, 88, 88)`` array per row."""
    images = decode_images(pdf["content"].values)
    pdf = pdf.copy()
    pdf["content"] = list(images)
    return pdf


class ByValue:
    """Wraps a function so that plain ``pickle`` sends it by value (through cloudpickle).

    Petastorm's process pool pickles its ``TransformSpec`` with ``pickle`` into a freshly
    exec'ed interpreter whose ``__main__`` is not this script: a function of this script would
    be pickled by reference and fail to load there. This unpickles as the function itself.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        import cloudpickle

        return pickle.loads, (cloudpickle.dumps(self.fn),)


def petastorm_spec():
    from petastorm import TransformSpec

    return TransformSpec(ByValue(petastorm_transform),
                         edit_fields=[("content", np.uint8, (3, CROP, CROP), False)])


# -- the e2e model: the same for TorchEstimator and TorchDistributor ---------------------------
def make_cnn():
    """conv 3->16 k3 s2, conv 16->32 k3 s2, global average pool, linear 32->10; uint8 in,
    normalized in forward."""
    import torch

    class SmallCNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 16, 3, stride=2, padding=1)
            self.conv2 = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
            self.head = torch.nn.Linear(32, CLASSES)

        def forward(self, x):
            x = x.float() / 255.0
            x = torch.relu(self.conv1(x))
            x = torch.relu(self.conv2(x))
            return self.head(x.mean(dim=(2, 3)))

    return SmallCNN()


def td_train(converter, batch_size: int, seed: int, lr: float):
    """TorchDistributor's function: one epoch of the CNN in DDP (gloo) over this rank's shard of
    Petastorm's converter, decoded by a TransformSpec in 1 Petastorm worker process."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # TorchDistributor/torchrun set MASTER_ADDR, RANK, ...
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)  # sparktrain's ranks use the task's CPUs: 1 here
        torch.manual_seed(seed)
        model = torch.nn.parallel.DistributedDataParallel(make_cnn())
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        # Petastorm shards by row groups, so ranks hold different row counts: a fixed number of
        # steps over an endless reader keeps DDP's collectives matched (Petastorm's own advice)
        steps = len(converter) // (batch_size * world)
        images = 0
        with converter.make_torch_dataloader(
                batch_size=batch_size, num_epochs=None, workers_count=1,
                reader_pool_type="process", transform_spec=petastorm_spec(), cur_shard=rank,
                shard_count=world, shuffle_rows=True, seed=seed + rank) as loader:
            batches = iter(loader)
            for _ in range(steps):
                batch = next(batches)
                x, y = batch["content"], batch["label"].long()
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                images += len(y)
        if rank != 0:
            return None
        blob = io.BytesIO()
        torch.save(model.module.state_dict(), blob)
        return {"images": images * world, "steps": steps, "loss": float(loss.item()),
                "weights_bytes": len(blob.getvalue())}
    finally:
        dist.destroy_process_group()


# -- data ------------------------------------------------------------------------------------------
def _digit_images():
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images / 16.0, digits.target.astype(int)
    except ImportError:  # generated stand-ins: a ring of n bright blobs for class n
        progress("scikit-learn not found: drawing generated patterns instead of digits")
        rng = np.random.default_rng(0)
        yy, xx = np.mgrid[0:8, 0:8]
        images, labels = [], []
        for i in range(1000):
            label = i % CLASSES
            img = rng.uniform(0, 0.2, (8, 8))
            for k in range(label + 1):
                a = 2 * np.pi * k / (label + 1)
                dx, dy = xx - 3.5 - 2.5 * np.cos(a), yy - 3.5 - 2.5 * np.sin(a)
                img += np.exp(-(dx ** 2 + dy ** 2))
            images.append(np.clip(img, 0, 1))
            labels.append(label)
        return np.array(images), np.array(labels)


def _write_jpegs(job: Tuple[str, int, int, int]) -> int:
    """Images ``[start, stop)`` as ``<folder>/<index>_<label>.jpg``: a digit upscaled to a
    random size and place, in a random colour, on a random two-colour gradient with noise."""
    folder, start, stop, seed = job
    images, labels = _digit_images()
    rng = np.random.default_rng([seed, start])
    yy, xx = np.mgrid[0:SIDE, 0:SIDE] / (SIDE - 1.0)
    written = 0
    for index in range(start, stop):
        k = index % len(images)
        size = int(rng.integers(56, 88))
        glyph = np.asarray(Image.fromarray((images[k] * 255).astype(np.uint8))
                           .resize((size, size), Image.BILINEAR), np.float32) / 255.0
        c0, c1, fg = rng.uniform(0, 255, (3, 3))
        angle = rng.uniform(0, 2 * np.pi)
        t = ((np.cos(angle) * xx + np.sin(angle) * yy + 1.5) / 3.0)[..., None]
        alpha = np.zeros((SIDE, SIDE, 1), np.float32)
        top, left = rng.integers(0, SIDE - size + 1, 2)
        alpha[top:top + size, left:left + size, 0] = glyph
        background = (c0 * (1 - t) + c1 * t) * (1 - alpha)
        pixels = background + fg * alpha + rng.normal(0, 8, (SIDE, SIDE, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
            os.path.join(folder, f"{index:06d}_{labels[k]}.jpg"), format="JPEG", quality=QUALITY)
        written += 1
    return written


def write_dataset(tmp: str, images: int, e2e_images: int, seed: int) -> List[str]:
    """The JPEG files: images ``[0, e2e_images)`` in ``jpeg-a``, the rest in ``jpeg-b`` (so
    that the e2e figure can read a subset); returns the folders that hold files."""
    import multiprocessing

    folders = [os.path.join(tmp, "jpeg-a"), os.path.join(tmp, "jpeg-b")]
    ranges = [(0, e2e_images), (e2e_images, images)]
    jobs = []
    for folder, (lo, hi) in zip(folders, ranges, strict=True):
        os.makedirs(folder)
        step = max(1, -(-(hi - lo) // 16))
        jobs += [(folder, a, min(a + step, hi), seed) for a in range(lo, hi, step)]
    # fork: nothing else runs yet in this process (no Spark, no torch threads)
    with multiprocessing.get_context("fork").Pool(max(1, min(4, os.cpu_count() or 1))) as pool:
        written = sum(pool.map(_write_jpegs, jobs))
    assert written == images, (written, images)
    return [f for f, (lo, hi) in zip(folders, ranges, strict=True) if hi > lo]


def image_frame(spark, folders: List[str], partitions: int):
    """``content`` (binary) and ``label`` (int from the file name) of the JPEG files."""
    from pyspark.sql import functions as F

    return (spark.read.format("binaryFile").option("pathGlobFilter", "*.jpg").load(folders)
            .select("content",
                    F.regexp_extract("path", r"_(\d+)\.jpg$", 1).cast("int").alias("label"))
            .coalesce(partitions))


# -- loaders: one epoch each, (images, label sum, seconds to the first batch) ---------------------
def _check(x, y, batch_size: int) -> None:
    assert tuple(x.shape[1:]) == (3, CROP, CROP) and str(x.dtype) == "torch.uint8", \
        (x.shape, x.dtype)
    assert x.shape[0] == y.shape[0] and 0 < y.shape[0] <= batch_size, (x.shape, y.shape)

def _consume(batches: Iterable[Dict[str, Any]], batch_size: int,
             start: float) -> Tuple[int, int, float]:
    """Iterate one epoch of torch batches: (images, sum of labels, seconds to the first batch)."""
    images = label_sum = 0
    first = None
    for batch in batches:
        x, y = batch["content"], batch["label"]
        if first is None:
            first = time.perf_counter() - start
            _check(x, y, batch_size)
        images += x.shape[0]
        label_sum += int(y.sum())
    return images, label_sum, first or 0.0



class SparktrainLoader:
    """One rank's read + decode as a fit has it: ``ShardReader`` (shuffle on) and ``BatchFeed``
    (``transformation_fn`` = ``decode``), each batch turned into tensors with torch.from_numpy."""

    def __init__(self, ds, pool: str, workers: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1) -> None:
        from sparktrain.data.reader import ShardReader
        from sparktrain.data.transform_stage import BatchFeed

        self.batch_size = batch_size
        # TorchEstimator: train_reader_num_workers=N -> prefetch N row groups, N decode workers
        self.reader = ShardReader(ds.root, ds.files["train"], ds.columns, rank=rank,
                                  world_size=world_size, batch_size=batch_size, shuffle=True,
                                  seed=seed, prefetch=workers)
        self.feed = BatchFeed(decode, [c.name for c in ds.columns], reader_pool=pool,
                              workers={"train": workers}, seed=seed)

    def epoch(self, epoch: int) -> Tuple[int, int, float]:
        import torch

        start = time.perf_counter()
        return _consume(({k: torch.from_numpy(b[k]) for k in ("content", "label")}
                         for b in self.feed(self.reader.epoch(epoch), "train", epoch)),
                        self.batch_size, start)

    def close(self) -> None:
        self.feed.close()
        self.reader.close()


def _make_parquet_dataset(paths: List[str], batch_size: int, seed: int):
    import torch

    class ParquetImages(torch.utils.data.IterableDataset):
        """Batches of the Parquet files' rows, decoded in the DataLoader's workers: what a user
        writes by hand.

        Every epoch each worker draws the same plan (row groups in a random order, rows shuffled
        within each group, cut into batches of ``batch_size`` across group boundaries) and
        decodes every W-th batch, so the workers share the decoding evenly whatever the row
        group sizes (Spark leaves a small last group in each file; splitting by row groups
        would give one worker most of the work) and the DataLoader's round-robin over its
        workers yields the plan's order. Each worker reads every row group (cheap next to
        decoding: the JPEGs are stored uncompressed) and holds at most the groups of one batch.
        """

        def __init__(self) -> None:
            import pyarrow.parquet as pq

            self.groups = []  # (path, row group, rows) from the footers
            for path in paths:
                meta = pq.ParquetFile(path).metadata
                self.groups += [(path, g, meta.row_group(g).num_rows)
                                for g in range(meta.num_row_groups)]
            self.epoch = -1  # each (persistent) worker's copy counts the epochs it served

        def plan(self, epoch: int) -> List[List[Tuple[int, np.ndarray]]]:
            """The epoch's batches, each a list of (row group, row indices in it)."""
            rng = np.random.default_rng([seed, epoch])
            batches, current, filled = [], [], 0
            for group in rng.permutation(len(self.groups)):
                rows = rng.permutation(self.groups[group][2])
                offset = 0
                while offset < len(rows):
                    take = rows[offset:offset + batch_size - filled]
                    current.append((group, take))
                    filled += len(take)
                    offset += len(take)
                    if filled == batch_size:
                        batches.append(current)
                        current, filled = [], 0
            if current:
                batches.append(current)
            return batches

        def __iter__(self):
            import pyarrow.parquet as pq

            self.epoch += 1
            info = torch.utils.data.get_worker_info()
            worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
            handles: Dict[str, Any] = {}
            loaded: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
            for parts in self.plan(self.epoch)[worker::workers]:
                needed = {group for group, _ in parts}
                for group in list(loaded):
                    if group not in needed:  # plan order: a group once left is never needed
                        del loaded[group]
                for group in needed - set(loaded):
                    path, index, _ = self.groups[group]
                    if path not in handles:
                        handles[path] = pq.ParquetFile(path)
                    table = handles[path].read_row_group(index, columns=["content", "label"])
                    loaded[group] = (table.column("content").to_numpy(zero_copy_only=False),
                                     table.column("label").to_numpy())
                    del table
                yield decode({
                    "content": np.concatenate([loaded[g][0][rows] for g, rows in parts]),
                    "label": np.concatenate([loaded[g][1][rows] for g, rows in parts])})
            loaded.clear()
            for handle in handles.values():
                handle.close()

    return ParquetImages()


def _seed_worker(worker_id: int) -> None:
    import torch

    np.random.seed(torch.initial_seed() % (1 << 32))  # torch seeds only its own and random's


class TorchDataLoader:
    """``torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=N,
    persistent_workers=True)`` over the Parquet files sparktrain materialized."""

    def __init__(self, ds, workers: int, batch_size: int, seed: int) -> None:
        import torch

        self.batch_size = batch_size
        paths = [f"{ds.root}/{name}" for name, _ in ds.files["train"]]
        self.loader = torch.utils.data.DataLoader(
            _make_parquet_dataset(paths, batch_size, seed), batch_size=None,
            num_workers=workers, persistent_workers=workers > 0, worker_init_fn=_seed_worker)

    def epoch(self, epoch: int) -> Tuple[int, int, float]:
        return _consume(self.loader, self.batch_size, time.perf_counter())

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.loader = None


class PetastormLoader:
    """``converter.make_torch_dataloader(batch_size, num_epochs=1, workers_count=N,
    reader_pool_type="process", transform_spec=...)``, a new one per epoch (num_epochs=1)."""

    def __init__(self, converter, workers: int, batch_size: int, seed: int,
                 loader_fn: Any = None) -> None:
        self.converter, self.workers = converter, workers
        self.batch_size, self.seed, self.loader_fn = batch_size, seed, loader_fn

    def epoch(self, epoch: int) -> Tuple[int, int, float]:
        start = time.perf_counter()
        kwargs = {"data_loader_fn": self.loader_fn} if self.loader_fn is not None else {}
        with self.converter.make_torch_dataloader(
                batch_size=self.batch_size, num_epochs=1, workers_count=self.workers,
                reader_pool_type="process", transform_spec=petastorm_spec(),
                shuffle_rows=True, seed=self.seed + epoch, **kwargs) as loader:
            return _consume(loader, self.batch_size, start)

    def close(self) -> None:
        pass


def petastorm_importable() -> Optional[str]:
    """``None`` when Petastorm's Spark converter imports, else why not."""
    try:
        import petastorm.spark  # noqa: F401  (fails with pyarrow >= 15: pyarrow.filesystem)
        import zmq  # noqa: F401  (its process pool)
        return None
    except ImportError as exc:
        return f"Petastorm cannot import on this stack ({type(exc).__name__}: {exc})"


# -- figures 1-3: loader throughput ------------------------------------------------------------
def decode_ceiling(ds, batch_size: int, images: int) -> float:
    """images/s of ``decode`` alone in this process on batches already in memory (one core)."""
    from sparktrain.data.reader import ShardReader

    reader = ShardReader(ds.root, ds.files["train"], ds.columns, 0, 1, batch_size)
    batches, n = [], 0
    for batch in reader.epoch(0):
        batches.append(batch)
        n += len(batch["label"])
        if n >= images:
            break
    reader.close()
    decode(batches[0])  # warm-up
    seconds, _ = timed(lambda: [decode(b) for b in batches])
    return n / seconds


def bench_loaders(args, ds, spark, df, tmp: str, state: Dict[str, Any]) -> List[Dict[str, Any]]:
    want = {name for name in ("workers", "dataloader", "petastorm") if name not in args.skip}
    no_petastorm = petastorm_importable() if "petastorm" in want else None
    if no_petastorm:
        progress(f"petastorm: {no_petastorm}; its figure is reported without a baseline")
    B, seed, n = args.batch_size, args.seed, state["images"]
    loaders: Dict[str, Any] = {}
    labels: Dict[str, str] = {}
    converter = None
    try:
        # the DataLoader first: it forks its workers from this process, best before sparktrain's
        # pools have started feeder threads here
        if "dataloader" in want:
            loaders["dataloader"] = TorchDataLoader(ds, 2, B, seed)
            labels["dataloader"] = "torch DataLoader(num_workers=2, persistent_workers=True)"
        loaders["process-2"] = SparktrainLoader(ds, "process", 2, B, seed)
        labels["process-2"] = "sparktrain reader_pool='process', 2 decode workers"
        if "workers" in want:
            loaders["process-1"] = SparktrainLoader(ds, "process", 1, B, seed)
            labels["process-1"] = "sparktrain reader_pool='process', 1 decode worker"
            # (workers only sets the row groups read ahead here: TorchEstimator's default 2)
            loaders["thread"] = SparktrainLoader(ds, "thread", 2, B, seed)
            labels["thread"] = "sparktrain reader_pool='thread' (decode in the loop)"
        if "petastorm" in want and not no_petastorm:
            from petastorm.pytorch import BatchedDataLoader
            from petastorm.spark import SparkDatasetConverter, make_spark_converter

            spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF,
                           "file://" + os.path.join(tmp, "petastorm-cache"))
            progress("loaders: creating the Petastorm converter (timed apart, not in the rate)")
            state["petastorm_convert_seconds"], converter = timed(lambda: make_spark_converter(df))
            progress(f"loaders: converter ready in {state['petastorm_convert_seconds']:.1f}s, "
                     f"{len(converter):,} rows")
            loaders["petastorm"] = PetastormLoader(converter, 2, B, seed)
            labels["petastorm"] = "petastorm DataLoader"
            loaders["petastorm-batched"] = PetastormLoader(converter, 2, B, seed,
                                                           BatchedDataLoader)
            labels["petastorm-batched"] = "petastorm BatchedDataLoader"

        runs: Dict[str, List[float]] = {k: [] for k in loaders}
        firsts: Dict[str, List[float]] = {k: [] for k in loaders}
        warm: Dict[str, float] = {}
        sums: Dict[str, set] = {k: set() for k in loaders}

        cpu_ms: Dict[str, List[float]] = {k: [] for k in loaders}

        def one(name: str, epoch: int) -> float:
            before = tree_cpu()
            seconds, (images, label_sum, first) = timed(lambda: loaders[name].epoch(epoch))
            after = tree_cpu()
            if images != n:
                raise AssertionError(f"{labels[name]} delivered {images} images, expected {n}")
            sums[name].add(label_sum)
            firsts[name].append(first)
            cpu = sum(t - before.get(pid, 0.0) for pid, t in after.items())
            cpu_ms[name].append(1000 * cpu / images)
            return images / seconds

        for name in loaders:  # warm-up epoch: starts the workers, fills the page cache
            warm[name] = one(name, 0)
            progress(f"loaders: {labels[name]} warm-up epoch {warm[name]:,.0f} images/s")
        names = list(loaders)
        for i in range(args.repeats):  # alternate, rotating the order: load hits all alike
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                rate = one(name, i + 1)
                runs[name].append(rate)
                progress(f"loaders: {labels[name]} epoch {i + 1}/{args.repeats}: "
                         f"{rate:,.0f} images/s, {cpu_ms[name][-1]:.2f} CPU ms/image")
        label_sums = set().union(*sums.values())
        if len(label_sums) != 1:  # every loader must deliver every image exactly once
            raise AssertionError(f"label sums differ between loaders/epochs: {sums}")
        ceiling = decode_ceiling(ds, B, min(n, 2000))
        progress(f"loaders: decode alone in one process: {ceiling:,.0f} images/s")
    finally:
        for loader in loaders.values():
            loader.close()
        if converter is not None:
            converter.delete()

    med = {k: statistics.median(v) for k, v in runs.items()}
    first_med = {k: statistics.median(v) for k, v in firsts.items()}
    # timed epochs only (the warm-up's includes starting the workers)
    cpu = {k: statistics.median(v[1:]) for k, v in cpu_ms.items()}
    p2 = med["process-2"]
    what = (f"images/s into the training loop (torch tensors), {n:,} JPEGs, batch {B}, rank 0 "
            f"of 1, shuffled, epochs 1..{args.repeats} after a warm-up epoch, median")
    all_runs = {"epochs": runs, "warm_up_epoch": warm, "first_batch_s": firsts,
                "cpu_ms_per_image": cpu_ms}

    def cpu_line(*names: str) -> Dict[str, Any]:
        return {"CPU ms per image (process tree but the JVM), " + " / ".join(names): {
            "value": " / ".join(f"{cpu[k]:.2f}" for k in names),
            "note": f"decode alone: {1000 / ceiling:.2f}"}}
    results = []
    if "workers" in want:
        results.append(figure(
            "workers", what + "; ratio = 2 workers / 1 worker", "images/s", p2,
            med["process-1"], labels["process-1"], p2 / med["process-1"], 1.6, ">=", {
                labels["thread"]: {"value": med["thread"], "unit": "images/s",
                                   "note": f"2 workers reach {p2 / med['thread']:.2f}x it"},
                "ceiling: decode alone, one process, batches in memory": {
                    "value": ceiling, "unit": "images/s",
                    "note": f"2 workers reach {p2 / ceiling:.2f}x one core's decode "
                            f"({os.cpu_count()} CPUs)"},
                "first epoch (decode workers starting), 1 / 2 workers": {
                    "value": f"{warm['process-1']:,.0f} / {warm['process-2']:,.0f} images/s"},
                "seconds to the first batch, 1 / 2 workers": {
                    "value": f"{first_med['process-1']:.3f} / {first_med['process-2']:.3f} s"},
                **cpu_line("process-1", "process-2", "thread"),
                "sparktrain materialize (binaryFile frame -> store)": {
                    "value": state["materialize_seconds"], "unit": "s",
                    "note": state["layout_note"]},
                "runs": all_runs}))
    if "dataloader" in want:
        dl = med["dataloader"]
        results.append(figure(
            "dataloader", what + "; ratio = sparktrain 2 workers / DataLoader 2 workers",
            "images/s", p2, dl,
            "torch DataLoader(IterableDataset over the Parquet files, num_workers=2, "
            "persistent_workers=True)", p2 / dl, 1.0, ">=", {
                "DataLoader first epoch (workers starting)": {
                    "value": warm["dataloader"], "unit": "images/s"},
                "DataLoader start method": {"value": _start_method()},
                **cpu_line("process-2", "dataloader"),
                "runs": all_runs}))
    if "petastorm" in want:
        if no_petastorm:
            results.append(dict(figure(
                "petastorm", what + "; ratio = sparktrain 2 workers / Petastorm", "images/s",
                p2, None, "petastorm make_spark_converter + make_torch_dataloader(TransformSpec, "
                "workers_count=2, reader_pool_type='process')", None, 2.0, ">=",
                {"not measured": {"value": None, "note": no_petastorm}}),
                status=f"baseline not measured: {no_petastorm}"))
        else:
            ps, psb = med["petastorm"], med["petastorm-batched"]
            results.append(figure(
                "petastorm", what + "; ratio = sparktrain 2 workers / Petastorm (its loader "
                "re-created per epoch, num_epochs=1: worker start-up included)", "images/s",
                p2, ps, "petastorm make_spark_converter + make_torch_dataloader(TransformSpec, "
                "workers_count=2, reader_pool_type='process', num_epochs=1)", p2 / ps, 2.0,
                ">=", {
                    "petastorm with data_loader_fn=BatchedDataLoader": {
                        "value": psb, "unit": "images/s",
                        "note": f"sparktrain reaches {p2 / psb:.2f}x it"},
                    **cpu_line("process-2", "petastorm"),
                    "seconds to the first batch, sparktrain / petastorm": {
                        "value": f"{first_med['process-2']:.3f} / "
                                 f"{first_med['petastorm']:.3f} s"},
                    "petastorm make_spark_converter(df) (not in the rate)": {
                        "value": state["petastorm_convert_seconds"], "unit": "s",
                        "note": f"sparktrain materialize: {state['materialize_seconds']:.2f} s"},
                    "runs": all_runs}))
    return results


def _start_method() -> str:
    import multiprocessing

    return multiprocessing.get_start_method(allow_none=True) or \
        multiprocessing.get_context().get_start_method()


# -- figure 4: rss over epochs, in a fresh process ------------------------------------------------
def _tree(root: int, skip_jvm: bool = False) -> List[int]:
    """``root`` and all its descendants (decode workers are children of the forkserver);
    ``skip_jvm``: without Spark's JVM and its children (its Python workers)."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        if skip_jvm and pid != root and _comm(pid) == "java":
            continue
        pids.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return pids


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 when it ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def tree_cpu() -> Dict[Any, float]:
    """CPU seconds of this process and its live descendants but Spark's JVM, by pid, and under
    ``"ended"`` those of the children that ended and were waited for (Petastorm's workers)."""
    import resource

    out: Dict[Any, float] = {pid: _cpu_seconds(pid)
                             for pid in _tree(os.getpid(), skip_jvm=True)}
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    out["ended"] = ended.ru_utime + ended.ru_stime
    return out


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0  # ended meanwhile


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return int(re.search(r"^Pss:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
    except (OSError, AttributeError):
        return 0


def _hwm_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024
    except (OSError, AttributeError):
        return 0.0


def rss_child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Runs in a fresh process: ``spec["epochs"]`` epochs of one rank's loader with N decode
    workers; the tree's RSS (this process + descendants) sampled by a thread."""
    import torch  # noqa: F401  (what a rank has imported)

    from sparktrain.data.columns import ColumnSpec
    from sparktrain.data.materialize import MaterializedDataset

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    ds = MaterializedDataset(spec["root"], [ColumnSpec.from_json(c) for c in spec["columns"]],
                             {}, "", files={"train": spec["layout"]})
    me = os.getpid()
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            total = sum(_rss_bytes(p) for p in _tree(me))
            if total > peak[0]:
                peak[0] = total
            stop.wait(spec["interval"])

    baseline = sum(_rss_bytes(p) for p in _tree(me))
    loader = SparktrainLoader(ds, "process", spec["workers"], spec["batch"], spec["seed"],
                              rank=0, world_size=spec["world_size"])
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    epochs = []
    try:
        for epoch in range(spec["epochs"]):
            peak[0] = 0
            seconds, (images, _, _) = timed(lambda epoch=epoch: loader.epoch(epoch))
            pids = _tree(me)
            end = sum(_rss_bytes(p) for p in pids)
            epochs.append({"epoch": epoch + 1, "images": images, "seconds": seconds,
                           "peak_mib": max(peak[0], end) / 2 ** 20, "end_mib": end / 2 ** 20,
                           "end_pss_mib": sum(_pss_bytes(p) for p in pids) / 2 ** 20,
                           "end_parent_mib": _rss_bytes(me) / 2 ** 20, "processes": len(pids)})
        hwm = {str(p): _hwm_mib(p) for p in _tree(me)}
    finally:
        stop.set()
        thread.join()
        loader.close()
    return {"baseline_mib": baseline / 2 ** 20, "epochs": epochs, "parent_hwm_mib": _hwm_mib(me),
            "hwm_by_pid_mib": hwm}


def bench_rss(args, ds, tmp: str, state: Dict[str, Any]) -> Dict[str, Any]:
    spec = {"root": ds.root, "layout": ds.files["train"],
            "columns": [c.to_json() for c in ds.columns], "batch": args.batch_size,
            "workers": 2, "epochs": RSS_EPOCHS, "seed": args.seed,
            "world_size": args.rss_world_size, "interval": 0.05}
    runs = []
    for i in range(args.repeats):
        run = run_child(os.path.abspath(__file__), spec, args.fit_timeout * 4, "rss child")
        runs.append(run)
        peaks = [e["peak_mib"] for e in run["epochs"]]
        progress(f"rss: run {i + 1}/{args.repeats}: tree peak per epoch "
                 f"{', '.join(f'{p:.0f}' for p in peaks)} MiB "
                 f"({run['epochs'][-1]['processes']} processes), "
                 f"{sum(e['seconds'] for e in run['epochs']):.1f}s")
    last, second = RSS_EPOCHS - 1, 1
    growth = statistics.median(r["epochs"][last]["peak_mib"] / r["epochs"][second]["peak_mib"]
                               for r in runs)
    med = lambda key, e: statistics.median(r["epochs"][e][key] for r in runs)  # noqa: E731
    images = runs[0]["epochs"][0]["images"]
    return figure(
        "rss", f"peak RSS (sum of VmRSS over the process tree: rank + forkserver + decode "
               f"workers, sampled every {spec['interval'] * 1000:.0f} ms) per epoch, fresh "
               f"process, 2 decode workers, rank 0 of {args.rss_world_size} ({images:,} images/"
               f"epoch), batch {args.batch_size}, {RSS_EPOCHS} epochs; ratio = peak in epoch "
               f"{RSS_EPOCHS} / peak in epoch 2, median of {args.repeats}", "MiB",
        med("peak_mib", last), med("peak_mib", second), "the same tree's peak in epoch 2",
        growth, 1.05, "<=", {
            "peak per epoch (median over runs)": {
                "value": " ".join(f"{med('peak_mib', e):.0f}" for e in range(RSS_EPOCHS)),
                "unit": "MiB"},
            "PSS of the tree at the end of epoch 2 / 10": {
                "value": f"{med('end_pss_mib', second):.0f} / {med('end_pss_mib', last):.0f} MiB",
                "note": "shared pages counted once"},
            "the rank process alone at the end of epoch 2 / 10 (VmRSS)": {
                "value": f"{med('end_parent_mib', second):.0f} / "
                         f"{med('end_parent_mib', last):.0f} MiB"},
            "rank process before reading (interpreter + torch + pyarrow)": {
                "value": statistics.median(r["baseline_mib"] for r in runs), "unit": "MiB"},
            "epoch time (median of epochs 2..10)": {
                "value": statistics.median(e["seconds"] for r in runs for e in r["epochs"][1:]),
                "unit": "s"},
            "runs": runs})


# -- figure 5: end to end --------------------------------------------------------------------------
class _MaterializeLog(logging.Handler):
    """Catches sparktrain's 'materialized ... in N s' log line (the fit's own write time)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: List[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("materialized "):
            self.seconds.append(float(record.args[-1]))


def bench_e2e(args, spark, df, tmp: str, state: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    from sparktrain import TorchEstimator
    from sparktrain.data.reader import steps_per_epoch

    no_petastorm = petastorm_importable()
    B, seed, n = args.batch_size, args.seed, state["e2e_images"]
    limit, hangs = args.fit_timeout, state["hangs"]
    small = df.limit(E2E_WARMUP_IMAGES).repartition(2)
    catcher = _MaterializeLog()
    mat_log = logging.getLogger("sparktrain.data.materialize")
    mat_log.addHandler(catcher)
    old_level, old_propagate = mat_log.level, mat_log.propagate
    mat_log.setLevel(logging.INFO)
    mat_log.propagate = False  # caught here, not printed
    counter = iter(range(1 << 30))
    cleanups: List[Callable[[], None]] = []  # run after each timed call, outside its time

    def clean() -> None:
        while cleanups:
            cleanups.pop()()

    def st_fit(frame):
        store = os.path.join(tmp, f"e2e-store-{next(counter)}")  # fresh: materializes again
        cleanups.append(lambda: shutil.rmtree(store, ignore_errors=True))
        torch.manual_seed(seed)
        net = make_cnn()
        est = TorchEstimator(
            num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR,
                                                             momentum=0.9),
            loss=torch.nn.CrossEntropyLoss(), feature_cols=["content"], label_cols=["label"],
            batch_size=B, epochs=1, shuffle=True, random_seed=seed, transformation_fn=decode,
            reader_pool_type="process", train_reader_num_workers=1, verbose=0, store=store)
        model = est.fit(frame)
        assert len(model.getHistory()["loss"]) == 1
        return model.getHistory()["loss"][-1]

    def td_run(frame):
        from petastorm.spark import SparkDatasetConverter, make_spark_converter
        from pyspark.ml.torch.distributor import TorchDistributor

        spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF,
                       "file://" + os.path.join(tmp, "petastorm-e2e"))
        start = time.perf_counter()
        converter = make_spark_converter(frame)
        convert = time.perf_counter() - start
        cleanups.append(converter.delete)  # so that the next run converts again
        out = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
            td_train, converter, B, seed, LR)
        return {**out, "convert_s": convert}

    st_runs, td_runs, td_out = [], [], []
    try:
        progress(f"e2e: sparktrain warm-up fit ({E2E_WARMUP_IMAGES} images)")
        guarded(spark, lambda: st_fit(small), limit, "e2e: sparktrain warm-up", hangs)
        clean()
        catcher.seconds.clear()
        for i in range(args.repeats):
            seconds, loss = guarded(spark, lambda: st_fit(df), limit,
                                    f"e2e: sparktrain fit {i + 1}", hangs)
            clean()
            st_runs.append(seconds)
            progress(f"e2e: sparktrain fit {i + 1}/{args.repeats}: {seconds:.1f}s "
                     f"(loss {loss:.3f})")
        if no_petastorm:
            progress(f"e2e: {no_petastorm}; TorchDistributor + Petastorm not measured")
        else:
            progress(f"e2e: TorchDistributor + Petastorm warm-up ({E2E_WARMUP_IMAGES} images)")
            guarded(spark, lambda: td_run(small), limit, "e2e: TorchDistributor warm-up", hangs)
            clean()
            for i in range(args.repeats):
                seconds, out = guarded(spark, lambda: td_run(df), limit,
                                       f"e2e: TorchDistributor run {i + 1}", hangs)
                clean()
                td_runs.append(seconds)
                td_out.append(out)
                progress(f"e2e: TorchDistributor + Petastorm run {i + 1}/{args.repeats}: "
                         f"{seconds:.1f}s (converter {out['convert_s']:.1f}s, "
                         f"{out['images']:,} images, loss {out['loss']:.3f})")
    finally:
        clean()  # also what a failed or hung run left
        mat_log.removeHandler(catcher)
        mat_log.setLevel(old_level)
        mat_log.propagate = old_propagate

    st = statistics.median(st_runs)
    steps = steps_per_epoch(n, 2, B)
    what = (f"seconds from the binaryFile DataFrame ({n:,} JPEGs) to a fitted 2-rank CNN, 1 "
            f"epoch, batch {B}/rank, 1 decode worker per rank, local[2], materialization "
            f"included, median of {args.repeats} after a {E2E_WARMUP_IMAGES}-image warm-up; "
            f"ratio = baseline s / sparktrain s")
    extras: Dict[str, Any] = {
        "sparktrain materialization inside the fit": {
            "value": statistics.median(catcher.seconds) if catcher.seconds else None,
            "unit": "s"},
        "sparktrain images trained": {"value": f"{n:,} ({steps} steps/rank)"},
        **hang_extras(hangs, "e2e"),
        "runs": {"sparktrain_s": st_runs, "torchdistributor_s": td_runs,
                 "torchdistributor": td_out, "sparktrain_materialize_s": catcher.seconds}}
    name = ("TorchDistributor(num_processes=2) + Petastorm make_spark_converter / "
            "make_torch_dataloader(TransformSpec, workers_count=1, reader_pool_type='process')")
    if no_petastorm:
        return dict(figure("e2e", what, "s", st, None, name, None, 2.0, ">=",
                           {**extras, "not measured": {"value": None, "note": no_petastorm}}),
                    status=f"baseline not measured: {no_petastorm}")
    td = statistics.median(td_runs)
    extras["petastorm make_spark_converter inside the baseline"] = {
        "value": statistics.median(o["convert_s"] for o in td_out), "unit": "s"}
    extras["baseline images trained"] = {
        "value": f"{td_out[0]['images']:,} ({td_out[0]['steps']} steps/rank)"}
    return figure("e2e", what, "s", st, td, name, td / st, 2.0, ">=", extras)


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--images", type=int, default=20000, help="JPEG files generated")
    parser.add_argument("--e2e-images", type=int, default=None,
                        help="images the e2e fits train on (the first N; default: all)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch (per rank)")
    parser.add_argument("--partitions", type=int, default=2,
                        help="partitions of the binaryFile frame (coalesced; = files written)")
    parser.add_argument("--rss-world-size", type=int, default=2,
                        help="the rss figure reads rank 0's shard of this many ranks")
    add_common_args(parser, list(FIGURES), "bench_images.json", fit_timeout=600.0)
    args = parse_common(parser, argv, list(FIGURES))
    if args.e2e_images is None:
        args.e2e_images = args.images
    if args.images < 4 * args.batch_size:
        parser.error(f"--images must be at least {4 * args.batch_size} (4 batches)")
    if not 2 * args.batch_size <= args.e2e_images <= args.images:
        parser.error("--e2e-images must be between 2 batches and --images")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    # also in the processes started from here (Petastorm's workers, TorchDistributor's ranks):
    # Petastorm on pyarrow 14 warns about every deprecated pyarrow call it makes
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    quiet_warnings()

    tmp = tempfile.mkdtemp(prefix="sparktrain-bench-images-")
    progress(f"temp dir {tmp}")
    state: Dict[str, Any] = {"hangs": [], "images": args.images, "e2e_images": args.e2e_images}
    results: List[Dict[str, Any]] = []
    load_before = os.getloadavg()
    spark = None
    try:
        seconds, folders = timed(lambda: write_dataset(tmp, args.images, args.e2e_images,
                                                       args.seed))
        sizes = [os.path.getsize(os.path.join(f, name)) for f in folders for name in os.listdir(f)]
        state["jpeg_bytes_mean"] = sum(sizes) / len(sizes)
        progress(f"wrote {args.images:,} JPEGs ({SIDE}x{SIDE}, quality {QUALITY}, mean "
                 f"{state['jpeg_bytes_mean'] / 1024:.1f} KiB) in {seconds:.1f}s")

        from sparktrain import local_spark
        from sparktrain.data.materialize import materialize
        from sparktrain.data.schema import training_columns
        from sparktrain.data.store import Store

        progress(f"starting Spark {args.master}")
        spark = local_spark(args.master, "sparktrain-bench-images", conf={
            **spark_conf(tmp, "2g"), "spark.sql.shuffle.partitions": "2"})
        df = image_frame(spark, folders, args.partitions)
        e2e_df = image_frame(spark, folders[:1], args.partitions) \
            if args.e2e_images < args.images else df
        count = df.count()
        assert count == args.images, (count, args.images)

        need_store = bool({"workers", "dataloader", "petastorm", "rss"} - args.skip)
        if need_store:
            progress("materializing the frame with sparktrain (the files every loader reads)")
            seconds, ds = timed(lambda: materialize(
                df, Store.create(os.path.join(tmp, "store")),
                training_columns(df, ["content"], ["label"])))
            groups = [g for _, gs in ds.files["train"] for g in gs]
            state["materialize_seconds"] = seconds
            state["layout_note"] = (f"{len(ds.files['train'])} files, {len(groups)} row groups "
                                    f"of {min(groups):,}-{max(groups):,} images")
            progress(f"materialized {ds.train_rows:,} rows in {seconds:.1f}s: "
                     f"{state['layout_note']}")
            assert ds.train_rows == args.images
            if {"workers", "dataloader", "petastorm"} - args.skip:
                progress("== workers / dataloader / petastorm ==")
                results += bench_loaders(args, ds, spark, df, tmp, state)
            else:
                progress("skipping workers, dataloader, petastorm")
            if "rss" not in args.skip:
                progress("== rss ==")
                results.append(bench_rss(args, ds, tmp, state))
            else:
                progress("skipping rss")
        else:
            progress("skipping workers, dataloader, petastorm, rss")
        if "e2e" not in args.skip:
            progress("== e2e ==")
            results.append(bench_e2e(args, spark, e2e_df, tmp, state))
        else:
            progress("skipping e2e")
    finally:
        if spark is not None:
            spark.stop()
        remove_tmp(tmp, args.keep_tmp)

    order = {name: i for i, name in enumerate(FIGURES)}
    results.sort(key=lambda r: order[r["figure"]])
    names = ("images", "e2e_images", "batch_size", "partitions", "rss_world_size", "repeats",
             "master")
    title = (f"sparktrain image benchmark: {args.images:,} JPEGs {SIDE}x{SIDE} (mean "
             f"{state['jpeg_bytes_mean'] / 1024:.1f} KiB) -> uint8 3x{CROP}x{CROP}, batch "
             f"{args.batch_size}, {args.master}, {load_note(load_before)}")
    report(results, args.json_out, lambda: {
        **arg_meta(args, *names), "skipped": sorted(args.skip),
        "jpeg_bytes_mean": state["jpeg_bytes_mean"], **load_meta(load_before), **versions()},
        title)
    return 0


if __name__ == "__main__":
    child_entry(rss_child)
    sys.exit(main())
