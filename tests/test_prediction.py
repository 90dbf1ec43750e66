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


@pytest.mark.parametrize("feature", ["vec", "arr"])
def test_arrow_and_pandas_udfs_predict_the_same(frame, feature, monkeypatch):
    import torch

    from sparktrain import TorchModel

    torch.manual_seed(1)
    one = TorchModel(model=torch.nn.Linear(3, 2), feature_columns=[feature],
                     label_columns=["y"])
    two = TorchModel(model=_TwoHeads(), feature_columns=[feature, "s"],
                     label_columns=["a", "b"])
    arrow = [_predictions(one, frame, ["y__output"]),
             _predictions(two, frame, ["a__output", "b__output"])]
    assert hasattr(F, "arrow_udf")  # the primary stack has Arrow UDFs: the path under test
    monkeypatch.delattr(F, "arrow_udf")  # what pyspark < 4.1 gives: the pandas UDF
    pandas = [_predictions(one, frame, ["y__output"]),
              _predictions(two, frame, ["a__output", "b__output"])]
    assert arrow == pandas
    assert len(arrow[0]) == 300 and len(arrow[1][0]) == 2 and len(arrow[1][0][1]) == 1
    out = one.transform(frame).schema["y__output"].dataType.simpleString()
    assert out == "array<double>"
    assert two.transform(frame).schema["b__output"].dataType.simpleString() == "double"
