"""Packaging for sparktrain: Spark ML estimators for distributed deep learning.

Requirements are the ranges sparktrain works with, never exact versions of a user's core
packages: ``pip install sparktrain[torch]`` must not move their Spark, NumPy, Arrow, pandas or
PyTorch. The exact versions of the two tested stacks live in ``constraints/`` and are used only by
``scripts/setup.sh`` (docs/supported-stacks.md).
"""
from setuptools import find_packages, setup

CORE = [
    "pyspark>=3.5",  # barrier mapPartitions, iterator pandas_udf, resource profiles
    "pyarrow>=14",   # with NumPy 2 pip picks pyarrow >= 16 (the first built for it) by itself
    "numpy>=1.26",
    "pandas>=2.2",  # the oldest tested (classic stack); pyspark 4 needs it too
    "cloudpickle>=2.2",
    "fsspec>=2023.1",
    "tqdm>=4.60",  # the driver's progress bar (terminal and Jupyter)
]
# tensorboard: torch's SummaryWriter; psutil: the DDP launcher finds the rank-0 address's
# network interface for Gloo (launch/torch_ddp.py)
TORCH = ["torch>=2.4", "tensorboard>=2.10", "psutil>=5.9"]
# TensorFlow comes as `tensorflow` or `tensorflow-cpu`, two distributions pip does not know
# are one: each extra names one of them, so a user keeps the one they have (as transformers'
# `tf` / `tf-cpu` extras do).
KERAS = ["keras>=3.0"]
TF = ["tensorflow>=2.16"] + KERAS  # 2.16: first TensorFlow whose tf.keras is Keras 3
TF_CPU = ["tensorflow-cpu>=2.16"] + KERAS
# TensorFlowOnSpark imports six (undeclared) and pkg_resources (gone in setuptools 81).
TFOS = ["tensorflowonspark>=2.2.5", "six", "setuptools<81"]
# Horovod must be compiled against the installed torch; scripts/setup.sh shows how (C++17 wrapper).
HOROVOD = ["horovod>=0.28.1"]
# Petastorm (only to read sparktrain's datasets with Petastorm's own readers: sparktrain does not
# need it) imports pyarrow.filesystem, removed in pyarrow 15, and pyarrow 14 does not load under
# NumPy 2: the extra states those limits, so it never installs a Petastorm that cannot import.
# 0.13 pins setuptools<70 (torch needs >= 77.0.3) and can return zero rows.
PETASTORM = ["petastorm>=0.12.1,<0.13", "pyarrow<15", "numpy<2", "setuptools<81"]
# Spark Connect clients: pyspark's own "connect" extra (grpcio, grpcio-status,
# googleapis-common-protos, zstandard); barrier mapInPandas over Connect needs pyspark 4.
CONNECT = ["pyspark[connect]>=4.0"]
PLOT = ["matplotlib>=3.7"]
# MLflow tracking (sparktrain.mlflow): the client only. `mlflow` itself pins pyarrow < 26
# (3.17.2) and would move a user's Arrow; mlflow-skinny has the tracking client and the
# pytorch/keras/spark/pyfunc flavors without that pin. A tracking server is the user's own
# (scripts/setup.sh puts one in .venv-mlflow for the tests). docs/mlflow.md
MLFLOW = ["mlflow-skinny>=3.1,<4"] + PLOT
# Hugging Face fine-tuning (docs/huggingface.md): models, tokenizers and LoRA adapters; the
# estimators take their models as they are, nothing in sparktrain imports these unless used.
# llguidance: answers that follow a responseSchema (TextGenerator, docs/generation.md).
HF = ["transformers>=4.40", "tokenizers>=0.15", "peft>=0.10", "safetensors>=0.4",
      "llguidance>=1.0"]
# Stores on HDFS from the driver and the ranks (docs/yarn-and-hdfs.md): hdfs-native, a native
# HDFS client with an fsspec interface (no JVM, no libhdfs.so, reads HADOOP_CONF_DIR). Where it
# is not installed, fsspec's hdfs:// is pyarrow's HadoopFileSystem (libhdfs.so and a Hadoop
# CLASSPATH, as on Hadoop's own nodes).
HDFS = ["hdfs-native>=0.10"]
# Stores on S3 (s3:// and s3a:// URLs) from the driver and the ranks: fsspec's S3 filesystem.
# Spark's own reads and writes of s3a:// (a materialized dataset, a saved model) need the
# cluster's hadoop-aws jars instead (docs/yarn-and-hdfs.md, "S3").
S3 = ["s3fs>=2023.1"]
# What a rank on a cluster needs beside its framework's extra: the executors open the store
# themselves (hdfs:// and s3:// clients) and torch's engines find rank 0's network interface
# with psutil. For the environment shipped to YARN: pip install 'sparktrain[cluster,torch]'
# (docs/yarn-and-hdfs.md); a fit names what its executors lack before any job writes a row.
CLUSTER = HDFS + S3 + ["psutil>=5.9"]
# Benchmarks only (bench/): the baselines they measure sparktrain against. bench_hf.py's
# baseline is Databricks' documented path, datasets.Dataset.from_spark + transformers.Trainer
# (with the `hf` extra); bench_end_to_end.py's include Ray Data + Ray Train (TorchTrainer).
# Never needed by sparktrain itself or its tests.
BENCH = ["datasets>=2.14", "ray[train]>=2.9"] + HF
# The demos' data (scikit-learn's bundled digits: no download) and images (Pillow).
EXAMPLES = ["scikit-learn>=1.4", "pillow>=10"]
# ruff and mypy: the linter and the type checker .ci/run runs (pyproject.toml configures them)
# coverage >= 7.10 for `[run] patch` (scripts/coverage.sh: Spark's Python workers and the ranks)
TEST = ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "coverage>=7.10", "packaging",
        "psutil",
        "nbclient>=0.9", "nbformat>=5.9", "ipykernel>=6.25", "ipywidgets>=8",
        "ruff>=0.8", "mypy>=1.10",
        # a real S3 endpoint on 127.0.0.1 for the S3 store tests (moto's threaded server)
        "moto[s3]>=5", "flask>=2.2", "flask-cors>=3",
        # packs the Python environment spark-submit ships to YARN (docs/yarn-and-hdfs.md)
        "venv-pack2>=0.9"] + EXAMPLES + PLOT + S3

setup(
    name="sparktrain",
    version="0.4.0",
    description="Train PyTorch and Keras models on Spark DataFrames with Spark ML estimators",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.14",
    packages=find_packages(include=["sparktrain", "sparktrain.*"]),
    package_data={"sparktrain": ["py.typed"]},  # PEP 561: the package's type hints are its API
    install_requires=CORE,
    extras_require={
        "torch": TORCH,
        "tf": TF,
        "tf-cpu": TF_CPU,
        "tfos": TFOS,
        "horovod": TORCH + HOROVOD,
        "petastorm": PETASTORM,
        "connect": CONNECT,
        "plot": PLOT,
        "mlflow": MLFLOW,
        "hf": HF,
        "hdfs": HDFS,
        "s3": S3,
        "cluster": CLUSTER,
        "bench": BENCH,
        "examples": EXAMPLES,
        "test": TEST,
    },
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
