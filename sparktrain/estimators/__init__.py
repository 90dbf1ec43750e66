"""Spark ML estimators and models, one framework per module (torch.py, keras.py)."""
