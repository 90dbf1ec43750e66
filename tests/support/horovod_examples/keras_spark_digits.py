"""Horovod's ``examples/spark/keras/keras_spark_mnist.py`` on scikit-learn's 8x8 digits, with a
custom object and a checkpoint callback (as Horovod's ``keras_spark_rossmann_estimator.py``).

The script body is what one writes for Horovod's ``horovod.spark.keras``; only the two
sparktrain imports below differ (Horovod: ``import horovod.spark.keras as hvd`` and
``from horovod.spark.common.store import Store``). The digits come from scikit-learn's bundled
copy instead of a download.

Run (executors need this Python: ``PYSPARK_PYTHON=.venv/bin/python``)::

    .venv/bin/python tests/support/horovod_examples/keras_spark_digits.py \
        --num-proc 2 --work-dir /tmp/w
"""
import argparse
import os

import numpy as np
import pyspark.sql.types as T
from pyspark import SparkConf
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import OneHotEncoder
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from pyspark.sql.functions import udf
from sklearn.datasets import load_digits

os.environ.setdefault('KERAS_BACKEND', 'tensorflow')
from tensorflow import keras
from tensorflow.keras.layers import Conv2D, Dense, Flatten, Input, MaxPooling2D
from tensorflow.keras.models import Sequential

import sparktrain.estimators.keras as hvd  # Horovod: import horovod.spark.keras as hvd
from sparktrain import Store  # Horovod: from horovod.spark.common.store import Store

parser = argparse.ArgumentParser(description='Keras Spark digits example',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--master',
                    help='spark master to connect to')
parser.add_argument('--num-proc', type=int, default=2,
                    help='number of worker processes for training')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size for training')
parser.add_argument('--epochs', type=int, default=6,
                    help='number of epochs to train')
parser.add_argument('--work-dir', default='/tmp',
                    help='temporary working directory to write intermediate files '
                         '(prefix with hdfs:// to use HDFS)')


def scaled_relu(x):
    """A custom activation: pixel values are 0..16, the first layer sees them scaled."""
    return keras.activations.relu(x / 16.0)


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

    # One-hot encode labels into SparseVectors
    encoder = OneHotEncoder(inputCols=['label'],
                            outputCols=['label_vec'],
                            dropLast=False)
    model = encoder.fit(df)
    train_df = model.transform(df)

    # Train/test split
    train_df, test_df = train_df.randomSplit([0.9, 0.1], seed=1)

    # Define the Keras model without any Horovod-specific parameters
    model = Sequential()
    model.add(Input(shape=(8, 8, 1)))
    model.add(Conv2D(32, kernel_size=(3, 3), activation=scaled_relu, padding='same'))
    model.add(MaxPooling2D(pool_size=(2, 2)))
    model.add(Flatten())
    model.add(Dense(64, activation='relu'))
    model.add(Dense(10, activation='softmax'))

    optimizer = keras.optimizers.Adam(0.003)
    loss = keras.losses.categorical_crossentropy

    # Keep the model of the epoch with the best validation loss
    checkpoint_callback = keras.callbacks.ModelCheckpoint(
        os.path.join(args.work_dir, 'checkpoint.keras'), monitor='val_loss', mode='min',
        save_best_only=True)

    # Train a Horovod Spark Estimator on the DataFrame
    keras_estimator = hvd.KerasEstimator(num_proc=args.num_proc,
                                         store=store,
                                         model=model,
                                         optimizer=optimizer,
                                         loss=loss,
                                         metrics=['accuracy'],
                                         custom_objects={'scaled_relu': scaled_relu},
                                         feature_cols=['features'],
                                         label_cols=['label_vec'],
                                         validation=0.1,
                                         batch_size=args.batch_size,
                                         epochs=args.epochs,
                                         random_seed=1,
                                         inmemory_cache_all=True,
                                         checkpoint_callback=checkpoint_callback,
                                         verbose=1)

    keras_model = keras_estimator.fit(train_df).setOutputCols(['label_prob'])

    # Evaluate the model on the held-out test DataFrame
    pred_df = keras_model.transform(test_df)
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
    conf = SparkConf().setAppName('keras_spark_digits').set('spark.sql.shuffle.partitions', '16')
    if args.master:
        conf.setMaster(args.master)
    elif args.num_proc:
        conf.setMaster('local[{}]'.format(args.num_proc))
    spark = SparkSession.builder.config(conf=conf).getOrCreate()

    train_and_evaluate(spark, args)

    spark.stop()
