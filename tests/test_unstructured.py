"""Images, text and sequences: binary (binaryFile PNGs), string, N-D and variable-length array
columns and Spark's image struct, decoded by transformation_fn (in worker processes for bytes),
through fit, transform, save and load, with both estimators; and the errors for what cannot
reach a model.

Full tier: test_keras_png_cnn_fit_transform_save_load and
test_keras_variable_length_sequences_padded. Only they give unstructured columns to
KerasEstimator, so only they catch PNG bytes or padded int64 sequences that its transformation_fn
and TensorFlow worker processes mishandle, or a KerasModel that cannot decode the raw bytes
again once saved and loaded. The quick tier fits these columns with TorchEstimator only."""
from __future__ import annotations

import io
import os
import signal

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F

from sparktrain import PreflightError, TorchEstimator, TrainingError
from support.helpers import assert_reload_predicts_the_same, class_accuracy

DIGITS = 600


@pytest.fixture(scope="module")
def png_dir(tmp_path_factory):
    """scikit-learn's bundled digits as 8x8 grayscale PNG files named by label."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    folder = tmp_path_factory.mktemp("digits-png")
    for i in range(DIGITS):
        pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}_{digits.target[i]}.png")
    return str(folder)


@pytest.fixture(scope="module")
def png_df(spark, png_dir):
    df = spark.read.format("binaryFile").load(png_dir) \
        .withColumn("label", F.regexp_extract("path", r"_(\d)\.png$", 1).cast("int")) \
        .select("content", "label").cache()
    df.count()
    return df


def decode_png(batch):
    """PIL decode to uint8 (rows, 1, 8, 8); the model normalizes (uint8 until the model)."""
    from PIL import Image

    images = [np.asarray(Image.open(io.BytesIO(data))) for data in batch["content"]]
    return dict(batch, content=np.stack(images)[:, None])


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(8 * 64, 10))

    def forward(self, x):
        return self.net(x.float() / 255.0)  # uint8 pixels normalized on the device


def cnn_estimator(store, **overrides):
    torch.manual_seed(0)
    net = SmallCNN()
    params = dict(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters(), 0.01),
                  loss=torch.nn.CrossEntropyLoss(), feature_cols=["content"],
                  label_cols=["label"], batch_size=32, epochs=4, random_seed=1, store=store,
                  transformation_fn=decode_png, verbose=0)
    params.update(overrides)
    return TorchEstimator(**params)


def test_png_cnn_fit_transform_save_load(spark, png_df, store, tmp_path):
    model = cnn_estimator(store).fit(png_df)  # bytes: decoded in worker processes by default
    assert model.getHistory()["loss"][-1] < model.getHistory()["loss"][0]
    # the raw binaryFile column: the model decodes with transformation_fn before predicting
    assert model.getPredictTransformationFn() is decode_png
    first = model.transform(png_df)
    assert class_accuracy(first) > 0.85
    assert_reload_predicts_the_same(model, first, png_df, str(tmp_path / "cnn"))


@pytest.mark.parametrize("backend,strategy", [("horovod", "ddp"), ("torch", "fsdp")])
def test_process_workers_on_other_engines(spark, png_df, store, backend, strategy):
    model = cnn_estimator(store, backend=backend, strategy=strategy, epochs=2,
                          reader_pool_type="process", train_reader_num_workers=1).fit(png_df)
    assert len(model.getHistory()["loss"]) == 2


def failing_decode(batch):
    if len(batch["content"]) < 64:  # not in the preflight's batch of 8... every rank batch is 32
        raise ValueError("cannot decode this image: truncated file")
    return decode_png(batch)


class KillDecodeWorker:
    """SIGKILLs the decode worker process at its 3rd batch (of every rank: a crash that would
    happen again)."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, batch):
        from pyspark import TaskContext

        if TaskContext.get() is not None:  # the driver's preflight runs in no task
            return decode_png(batch)
        self.seen += 1
        if self.seen == 3 and len(batch["content"]) == 32:
            os.kill(os.getpid(), signal.SIGKILL)
        return decode_png(batch)


def test_transformation_fn_raising_in_a_worker_is_not_retried(spark, png_df, store):
    est = cnn_estimator(store, epochs=1, reader_pool_type="process",
                        transformation_fn=lambda batch: failing_decode(batch)
                        if len(batch["content"]) > 8 else decode_png(batch))
    with pytest.raises(TrainingError, match="cannot decode this image") as info:
        est.fit(png_df)
    assert info.value.attempts == 1
    assert "not retried" in str(info.value) and "truncated file" in info.value.remote_traceback
    assert 'raise ValueError("cannot decode this image' in info.value.remote_traceback


def test_a_killed_decode_worker_fails_the_fit_clearly(spark, png_df, store):
    est = cnn_estimator(store, epochs=1, reader_pool_type="process",
                        transformation_fn=KillDecodeWorker())
    with pytest.raises(TrainingError, match="SIGKILL") as info:
        est.fit(png_df)
    assert info.value.attempts == 1
    assert "OOM" in str(info.value) or "out of memory" in str(info.value).lower()


# -- text and sequences ----------------------------------------------------------------------
VOCAB = {"good": 1, "great": 2, "fine": 3, "bad": 4, "awful": 5, "poor": 6}


def tokenize(batch):
    """A whitespace tokenizer to ids, padded to 6 tokens."""
    ids = np.zeros((len(batch["text"]), 6), dtype=np.int64)
    for row, text in enumerate(batch["text"]):
        tokens = [VOCAB.get(word, 0) for word in text.split()][:6]
        ids[row, :len(tokens)] = tokens
    return dict(batch, text=ids)


class BagOfEmbeddings(torch.nn.Module):
    def __init__(self, vocab: int = 8, classes: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(vocab, 8, mode="mean", padding_idx=0)
        self.out = torch.nn.Linear(8, classes)

    def forward(self, ids):
        return self.out(self.embed(ids))


@pytest.fixture(scope="module")
def text_df(spark):
    rng = np.random.default_rng(0)
    words = list(VOCAB)
    rows = []
    for _ in range(400):
        label = int(rng.integers(0, 2))
        pool = words[:3] if label == 0 else words[3:]
        rows.append((" ".join(rng.choice(pool, size=rng.integers(1, 6))) + " the", label,
                     [VOCAB[w] for w in rng.choice(pool, size=rng.integers(1, 9))]))
    df = spark.createDataFrame(rows, "text string, label int, tokens array<int>").cache()
    df.count()
    return df


def pad_tokens(batch):
    """Variable-length token ids (an object array of 1-D arrays) padded/truncated to 8."""
    ids = np.zeros((len(batch["tokens"]), 8), dtype=np.int64)
    for row, tokens in enumerate(batch["tokens"]):
        ids[row, :min(len(tokens), 8)] = tokens[:8]
    return dict(batch, tokens=ids)


@pytest.mark.parametrize("column,transformation_fn", [
    ("text", tokenize),  # a string column
    ("tokens", pad_tokens),  # variable-length sequences, padded
], ids=["string_column", "variable_length_sequences_padded"])
def test_torch_text_classifier(spark, text_df, store, column, transformation_fn):
    torch.manual_seed(0)
    net = BagOfEmbeddings()
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters(), 0.05),
                         loss=torch.nn.CrossEntropyLoss(), feature_cols=[column],
                         label_cols=["label"], batch_size=32, epochs=4, store=store,
                         transformation_fn=transformation_fn, random_seed=0, verbose=0)
    model = est.fit(text_df)
    assert class_accuracy(model.transform(text_df)) > 0.95


def test_bad_unstructured_inputs_fail_before_training(spark, text_df, png_df, store):
    net = BagOfEmbeddings()
    base = dict(num_proc=2, model=net, optimizer=torch.optim.SGD(net.parameters(), 0.1),
                loss=torch.nn.CrossEntropyLoss(), label_cols=["label"], store=store, verbose=0)
    with pytest.raises(ValueError, match="column 'text' is a string column; a model takes "
                                         "numbers: pass transformation_fn"):
        TorchEstimator(feature_cols=["text"], **base).fit(text_df)
    with pytest.raises(ValueError, match=r"column 'tokens' holds arrays of 1 to 8 elements; .*"
                                         r"transformation_fn that pads"):
        TorchEstimator(feature_cols=["tokens"], **base).fit(text_df)
    with pytest.raises(PreflightError, match="column 'text' reaches the model after "
                                             "transformation_fn as .* str"):
        TorchEstimator(feature_cols=["text"], transformation_fn=lambda b: b, **base).fit(text_df)
    # a decoded shape the model cannot take: the preflight names the column and the shapes
    with pytest.raises(PreflightError, match="content"):
        cnn_estimator(store, transformation_fn=lambda b: dict(
            decode_png(b), content=decode_png(b)["content"][:, :, :4])).fit(png_df)


def test_nested_array_column_reaches_the_model_as_a_grid(spark, store):
    rng = np.random.default_rng(0)
    grids = rng.normal(size=(200, 8, 8)).astype(np.float32)
    labels = (grids[:, 2, 3] > 0).astype(int)
    df = spark.createDataFrame([(g.tolist(), int(y)) for g, y in zip(grids, labels, strict=True)],
                               "grid array<array<float>>, label int")

    class Grid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.out = torch.nn.Linear(64, 2)

        def forward(self, x):
            assert x.dim() == 3 and tuple(x.shape[1:]) == (8, 8), x.shape
            return self.out(x.flatten(1))

    net = Grid()
    model = TorchEstimator(num_proc=2, model=net,
                           optimizer=torch.optim.Adam(net.parameters(), 0.05),
                           loss=torch.nn.CrossEntropyLoss(), feature_cols=["grid"],
                           label_cols=["label"], batch_size=20, epochs=8, store=store,
                           verbose=0).fit(df)
    assert class_accuracy(model.transform(df)) > 0.9
    bad = spark.createDataFrame([([[1.0, 2.0], [3.0, 4.0]], 0), ([[1.0, 2.0, 3.0]], 1)],
                                "grid array<array<float>>, label int")
    with pytest.raises(ValueError, match=r"column 'grid' has a row of shape \(1, 3, ...\); "
                                         r"expected every row to have the shape \(2, 2\)"):
        TorchEstimator(num_proc=1, model=net, optimizer=torch.optim.SGD(net.parameters(), 0.1),
                       loss=torch.nn.CrossEntropyLoss(), feature_cols=["grid"], store=store,
                       verbose=0).fit(bad)


def rgb_to_gray(batch):
    """Spark's image struct arrives as uint8 (H, W, C) RGB arrays."""
    images = np.stack([img.mean(axis=2).astype(np.uint8) for img in batch["image"]])
    return dict(batch, image=images[:, None])


def test_spark_image_format_column(spark, png_dir, store, tmp_path):
    from PIL import Image

    folder = tmp_path / "rgb"
    folder.mkdir()
    for name in sorted(os.listdir(png_dir))[:200]:  # RGB copies: the image source reads BGR
        Image.open(os.path.join(png_dir, name)).convert("RGB").save(folder / name)
    df = spark.read.format("image").load(str(folder)) \
        .withColumn("label", F.regexp_extract("image.origin", r"_(\d)\.png$", 1).cast("int"))
    model = cnn_estimator(store, feature_cols=["image"], transformation_fn=rgb_to_gray,
                          epochs=3).fit(df)
    assert class_accuracy(model.transform(df)) > 0.6


# -- Keras ---------------------------------------------------------------------------------------
def decode_png_hwc(batch):
    """PIL decode to uint8 (rows, 8, 8, 1) for a channels-last Keras model."""
    from PIL import Image

    images = [np.asarray(Image.open(io.BytesIO(data))) for data in batch["content"]]
    return dict(batch, content=np.stack(images)[..., None])


@pytest.mark.full
def test_keras_png_cnn_fit_transform_save_load(spark, png_df, store, tmp_path):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    keras = pytest.importorskip("keras")
    from sparktrain import KerasEstimator

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Rescaling(1 / 255.0),
                            keras.layers.Conv2D(8, 3, activation="relu"),
                            keras.layers.Flatten(), keras.layers.Dense(10)])
    est = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.Adam(0.01),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         feature_cols=["content"], label_cols=["label"], batch_size=32,
                         epochs=4, store=store, transformation_fn=decode_png_hwc,
                         random_seed=0, verbose=0)
    model = est.fit(png_df)
    first = model.transform(png_df)
    assert class_accuracy(first) > 0.85
    assert_reload_predicts_the_same(model, first, png_df, str(tmp_path / "keras-cnn"), atol=1e-6)


@pytest.mark.full  # Keras: TensorFlow rank processes of their own
def test_keras_variable_length_sequences_padded(spark, text_df, store):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    keras = pytest.importorskip("keras")
    from sparktrain import KerasEstimator

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((8,), dtype="int64"), keras.layers.Embedding(8, 8),
                            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    est = KerasEstimator(num_proc=2, model=net, optimizer=keras.optimizers.Adam(0.05),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         feature_cols=["tokens"], label_cols=["label"], batch_size=32,
                         epochs=5, store=store, transformation_fn=pad_tokens, random_seed=0,
                         verbose=0)
    model = est.fit(text_df)
    assert class_accuracy(model.transform(text_df)) > 0.9
