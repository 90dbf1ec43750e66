"""Horovod's ``examples/spark/pytorch/pytorch_spark_mnist.py`` on scikit-learn's 8x8 digits.

The script body is what one writes for Horovod's ``horovod.spark.torch``; only the two
sparktrain imports below differ (Horovod: ``import horovod.spark.torch as hvd`` and
``from horovod.spark.common.store import Store``). The digits come from scikit-learn's bundled
copy instead of a download.

Run (executors need this Python: ``PYSPARK_PYTHON=.venv/bin/python``)::

    .venv/bin/python tests/support/horovod_examples/pytorch_spark_digits.py \
        --num-proc 2 --work-dir /tmp/w
"""
import argparse

import numpy as np
import pyspark.sql.types as T
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from pyspark import SparkConf
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from pyspark.sql.functions import udf
from sklearn.datasets import load_digits

import sparktrain.estimators.torch as hvd  # Horovod: import horovod.spark.torch as hvd
from sparktrain import Store  # Horovod: from horovod.spark.common.store import Store

parser = argparse.ArgumentParser(description='PyTorch Spark digits example',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--master',
                    help='spark master to connect to')
parser.add_argument('--num-proc', type=int, default=2,
                    help='number of worker processes for training')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size for training')
parser.add_argument('--epochs', type=int, default=4,
                    help='number of epochs to train')
parser.add_argument('--work-dir', default='/tmp',
                    help='temporary working directory to write intermediate files '
                         '(prefix with hdfs:// to use HDFS)')
parser.add_argument('--backward-passes-per-step', type=int, default=1,
                    help='number of backward passes to perform before calling hvd.allreduce')


# Define the PyTorch model without any Horovod-specific parameters
class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.conv2_drop = nn.Dropout2d(0.1)
        self.fc1 = nn.Linear(128, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, features):
        x = features.float() / 16.0
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 128)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def digits_df(spark):
    """The 1797 8x8 digits as (features: 64-vector, label: double)."""
    digits = load_digits()
    rows = [(Vectors.dense(x.tolist()), float(y))
            for x, y in zip(digits.data, digits.target, strict=True)]
    return spark.createDataFrame(rows, ['features', 'label'])


def train_and_evaluate(spark, args):
    """Fit on 90% of the digits, return the test accuracy on the other 10%."""
    # Setup our store for intermediate data
    store = Store.create(args.work_dir)

    df = digits_df(spark)

    # Train/test split
    train_df, test_df = df.randomSplit([0.9, 0.1], seed=1)

    model = Net()
    optimizer = optim.Adam(model.parameters(), lr=0.003)
    loss = nn.NLLLoss()

    # Train a Horovod Spark Estimator on the DataFrame
    torch_estimator = hvd.TorchEstimator(num_proc=args.num_proc,
                                         store=store,
                                         model=model,
                                         optimizer=optimizer,
                                         loss=lambda input, target: loss(input, target.long()),
                                         input_shapes=[[-1, 1, 8, 8]],
                                         feature_cols=['features'],
                                         label_cols=['label'],
                                         batch_size=args.batch_size,
                                         epochs=args.epochs,
                                         validation=0.1,
                                         random_seed=1,
                                         backward_passes_per_step=args.backward_passes_per_step,
                                         verbose=1)

    torch_model = torch_estimator.fit(train_df).setOutputCols(['label_prob'])

    # Evaluate the model on the held-out test DataFrame
    pred_df = torch_model.transform(test_df)

    argmax = udf(lambda v: float(np.argmax(v)), returnType=T.DoubleType())
    pred_df = pred_df.withColumn('label_pred', argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(predictionCol='label_pred', labelCol='label',
                                                  metricName='accuracy')
    accuracy = evaluator.evaluate(pred_df)
    print('Test accuracy:', accuracy)
    return accuracy


if __name__ == '__main__':
    args = parser.parse_args()

    # Initialize SparkSession
    conf = SparkConf().setAppName('pytorch_spark_digits').set('spark.sql.shuffle.partitions', '16')
    if args.master:
        conf.setMaster(args.master)
    elif args.num_proc:
        conf.setMaster('local[{}]'.format(args.num_proc))
    spark = SparkSession.builder.config(conf=conf).getOrCreate()

    train_and_evaluate(spark, args)

    spark.stop()
