"""Horovod's Spark examples (``examples/spark/{pytorch,keras}``) on scikit-learn's digits,
running on sparktrain with only their imports changed."""
