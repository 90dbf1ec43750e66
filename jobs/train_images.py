#!/usr/bin/env python
"""Train a CNN on image files (a binaryFile DataFrame of PNG/JPEG bytes) with TorchEstimator.

    # the demo: scikit-learn's bundled digits written as PNG files (no download), read with
    # spark.read.format("binaryFile"), 2 ranks decoding with PIL in worker processes
    python jobs/train_images.py --demo

    # your images: a folder (any Hadoop filesystem) whose file names carry the label
    spark-submit --master yarn jobs/train_images.py --input hdfs:///data/images \\
        --label-regex '/(\\w+)/[^/]+$' --size 64 --num-proc 4 --epochs 10 \\
        --store hdfs:///user/me/sparktrain --output hdfs:///models/cnn

The images stay encoded in the store (the binary column is written as it is) and are decoded
per batch by ``transformation_fn`` in worker processes on each rank, to uint8 (H, W, C):
the model's first layer turns them into floats, so 4x fewer bytes cross to a GPU. Training
decodes with random crops and flips; prediction (``predict_transformation_fn``) decodes
without them. The fitted model is saved, reloaded and must predict the same; the job fails if
the test accuracy of the demo is below 0.95.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from typing import Dict, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jobs.common import get_spark  # noqa: E402 - after sys.path is set


def write_digit_pngs(folder: str, size: int) -> int:
    """scikit-learn's bundled digits as ``size`` x ``size`` grayscale PNG files named
    ``<index>_<label>.png``; returns how many."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        pixels = Image.fromarray((image * 255 / 16).astype(np.uint8))
        path = os.path.join(folder, f"{i:05d}_{label}.png")
        pixels.resize((size, size), Image.BILINEAR).save(path)
    return len(digits.target)


class Decode:
    """``transformation_fn``: PIL decode to uint8 ``(rows, 1, size, size)``; with ``augment``,
    a random crop (after padding by 2) and nothing else: digits must not be flipped."""

    def __init__(self, size: int, augment: bool) -> None:
        self.size, self.augment = size, augment

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        from PIL import Image

        out = np.empty((len(batch["content"]), 1, self.size, self.size), dtype=np.uint8)
        for row, data in enumerate(batch["content"]):
            image = Image.open(io.BytesIO(data)).convert("L")
            if image.size != (self.size, self.size):
                image = image.resize((self.size, self.size), Image.BILINEAR)
            pixels = np.asarray(image)
            if self.augment:  # seeded per batch by sparktrain: the same crops whatever the workers
                padded = np.pad(pixels, 2)
                top, left = np.random.randint(0, 5, size=2)
                pixels = padded[top:top + self.size, left:left + self.size]
            out[row, 0] = pixels
        return dict(batch, content=out)


def build_model(size: int, classes: int):
    import torch

    class CNN(torch.nn.Module):
        """uint8 pixels in, normalized here (on the device), two conv blocks, a linear head."""

        def __init__(self) -> None:
            super().__init__()
            self.features = torch.nn.Sequential(
                torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
            self.head = torch.nn.Linear(32 * (size // 4) ** 2, classes)

        def forward(self, x):
            return self.head(self.features(x.float() / 255.0).flatten(1))

    return CNN()


def accuracy(output, label):
    return (output.argmax(dim=1) == label).float().mean()


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--demo", action="store_true", help="digits as PNG files (no download)")
    source.add_argument("--input", help="folder of image files (binaryFile source)")
    p.add_argument("--label-regex", default=r"_(\d+)\.\w+$",
                   help="regex whose first group in a file's path is its integer label")
    p.add_argument("--size", type=int, default=16, help="image side the model takes")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--decode-workers", type=int, default=2,
                   help="decode worker processes per rank (train_reader_num_workers)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--store", default=None)
    p.add_argument("--output", default=None, help="where to save the fitted model")
    p.add_argument("--master", default=None)
    p.add_argument("--remote", default=None, help="a Spark Connect URL (sc://host:port)")
    return p.parse_args(list(argv))


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(argv)
    import torch
    from pyspark.sql import functions as F

    from sparktrain import TorchEstimator, TorchModel

    workdir = tempfile.mkdtemp(prefix="sparktrain-images-")
    folder = args.input
    if args.demo:
        folder = os.path.join(workdir, "png")
        os.makedirs(folder)
        print(f"wrote {write_digit_pngs(folder, args.size)} digit PNGs to {folder}", flush=True)
    spark = get_spark(args.master, "sparktrain-train-images", args.remote)
    images = spark.read.format("binaryFile").load(folder) \
        .withColumn("label", F.regexp_extract("path", args.label_regex, 1).cast("int")) \
        .select("path", "content", "label")
    train, test = images.randomSplit([0.8, 0.2], seed=args.seed)
    torch.manual_seed(args.seed)
    net = build_model(args.size, args.classes)
    est = TorchEstimator(
        num_proc=args.num_proc, model=net, optimizer=torch.optim.Adam(net.parameters(), args.lr),
        loss=torch.nn.CrossEntropyLoss(), metrics=[accuracy], feature_cols=["content"],
        label_cols=["label"], batch_size=args.batch_size, epochs=args.epochs,
        validation=0.1, random_seed=args.seed, store=args.store or os.path.join(workdir, "store"),
        transformation_fn=Decode(args.size, augment=True),
        predict_transformation_fn=Decode(args.size, augment=False),
        reader_pool_type="process", train_reader_num_workers=args.decode_workers, verbose=1)
    started = time.perf_counter()
    model = est.fit(train)
    print(f"fit in {time.perf_counter() - started:.1f}s; history: "
          f"{ {k: [round(v, 4) for v in vs] for k, vs in model.getHistory().items()} }", flush=True)
    predicted = F.expr("array_position(label__output, array_max(label__output)) - 1")
    scored = model.transform(test)  # the raw binaryFile rows: the model decodes them itself
    score = scored.select(F.avg((predicted == F.col("label")).cast("double"))).first()[0]
    print(f"test accuracy: {score:.4f}", flush=True)
    output = args.output or os.path.join(workdir, "model")
    model.write().overwrite().save(output)
    reloaded = TorchModel.load(output)
    a = np.stack(scored.orderBy("path").select("label__output").toPandas()["label__output"])
    b = np.stack(reloaded.transform(test).orderBy("path").select("label__output")
                 .toPandas()["label__output"])
    if not np.allclose(a, b, rtol=1e-5, atol=1e-6):
        print("the reloaded model predicts differently", file=sys.stderr)
        return 1
    print(f"saved to {output}; the reloaded model predicts the same", flush=True)
    if args.demo and score < 0.95:
        print(f"demo test accuracy {score:.4f} < 0.95", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
