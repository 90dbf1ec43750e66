"""transform through the Arrow UDF (pyspark >= 4.1) predicts exactly what the pandas UDF did,
for every column kind a model reads and for one and several outputs."""
import numpy as np
import pytest
from pyspark.sql import functions as F


class _TwoHeads:
    """A module with two outputs: a 2-wide one from the array features, a scalar from ``s``."""

    def __new__(cls):
        import torch

        class TwoHeads(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(3, 2)

            def forward(self, features, scalar):
                return self.linear(features), scalar * 2.0 + features.sum(dim=1, keepdim=True)

        torch.manual_seed(0)
        return TwoHeads()


@pytest.fixture(scope="module")
def frame(spark):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(3)
    rows = [(Vectors.dense(rng.normal(size=3).tolist()), rng.normal(size=3).tolist(),
             float(rng.normal()), int(i)) for i in range(300)]
    return spark.createDataFrame(rows, ["vec", "arr", "s", "id"]).repartition(3)


def _predictions(model, frame, columns):
    return {row["id"]: tuple(np.asarray(row[c], dtype=np.float64).ravel().tolist()
                             for c in columns)
            for row in model.transform(frame).collect()}


def _expected(frame, feature, one, two):
    """What the modules predict on the driver, row by row."""
    import torch

    expected = [{}, {}]
    with torch.no_grad():
        for row in frame.collect():
            x = torch.tensor([list(row[feature])], dtype=torch.float32)
            s = torch.tensor([[row["s"]]], dtype=torch.float32)
            a, b = two.getModel()(x, s)
            expected[0][row["id"]] = (tuple(one.getModel()(x)[0].double().tolist()),)
            expected[1][row["id"]] = (tuple(a[0].double().tolist()), tuple(b[0].double().tolist()))
    return expected


def _close(got, expected):
    assert got.keys() == expected.keys()
    for key, outputs in got.items():
        for mine, theirs in zip(outputs, expected[key], strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.stack  # the pandas UDF is what the classic stack (pyspark 3.5) predicts with
@pytest.mark.parametrize("feature", ["vec", "arr"])
def test_arrow_and_pandas_udfs_predict_the_same(frame, feature, monkeypatch):
    import torch

    from sparktrain import TorchModel

    torch.manual_seed(1)
    one = TorchModel(model=torch.nn.Linear(3, 2), feature_columns=[feature],
                     label_columns=["y"])
    two = TorchModel(model=_TwoHeads(), feature_columns=[feature, "s"],
                     label_columns=["a", "b"])

    def predictions():
        return [_predictions(one, frame, ["y__output"]),
                _predictions(two, frame, ["a__output", "b__output"])]

    expected = _expected(frame, feature, one, two)
    if hasattr(F, "arrow_udf"):  # pyspark >= 4.1: the Arrow UDF, then the pandas one
        arrow = predictions()
        for got, want in zip(arrow, expected, strict=True):
            _close(got, want)
        monkeypatch.delattr(F, "arrow_udf")  # what pyspark < 4.1 gives: the pandas UDF
        assert predictions() == arrow
    else:
        for got, want in zip(predictions(), expected, strict=True):
            _close(got, want)
    assert one.transform(frame).schema["y__output"].dataType.simpleString() == "array<double>"
    assert two.transform(frame).schema["b__output"].dataType.simpleString() == "double"
