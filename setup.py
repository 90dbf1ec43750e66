"""Packaging for sparktrain: Spark ML estimators for distributed deep learning."""
from setuptools import find_packages, setup

# Pins follow the stack verified in the README ("Supported stack"): pyspark 3.5 because Spark 4
# needs a pyarrow that Petastorm cannot read; pyarrow 14 because Petastorm 0.12 uses the legacy
# ParquetDataset API removed in pyarrow 15; numpy 1.x because pyarrow 14 fails under numpy 2.
CORE = [
    "pyspark>=3.5,<3.6",
    "pyarrow==14.0.2",
    "numpy>=1.26,<2",
    "pandas>=2.2,<2.3",
    "petastorm==0.12.1",
    "cloudpickle>=2.2",
    "fsspec>=2023.1",
    # tensorflowonspark and petastorm still import pkg_resources, removed in setuptools 81.
    "setuptools>=77.0.3,<81",
    "tqdm>=4.60",  # the driver's progress bar (terminal and Jupyter)
]
TORCH = ["torch==2.13.0", "tensorboard>=2.10"]  # tensorboard: torch's SummaryWriter
PLOT = ["matplotlib>=3.7"]
TF = ["tensorflow-cpu==2.21.0", "tf-keras==2.21.0", "tensorflowonspark==2.2.5", "six"]
# Horovod must be compiled against the installed torch; scripts/setup.sh does it (C++17 wrapper).
HOROVOD = ["horovod==0.28.1"]
TEST = ["pytest>=8", "pytest-timeout>=2.3", "scikit-learn>=1.4", "psutil",
        "nbclient>=0.9", "nbformat>=5.9", "ipykernel>=6.25", "ipywidgets>=8"] + PLOT

setup(
    name="sparktrain",
    version="0.1.0",
    description="Train PyTorch and Keras models on Spark DataFrames with Spark ML estimators",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["sparktrain", "sparktrain.*"]),
    install_requires=CORE,
    extras_require={
        "torch": TORCH,
        "tf": TF,
        "horovod": TORCH + HOROVOD,
        "plot": PLOT,
        "test": TEST,
        "all": TORCH + TF + HOROVOD + PLOT + TEST,
    },
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
