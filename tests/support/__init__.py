"""What the tests share and the scripts they run in processes of their own (not tests).

``from support.helpers import linear_estimator`` in a test (pytest puts ``tests/`` on
``sys.path``); a script here run as ``python tests/support/x.py`` puts ``tests/`` and the
repository root on ``sys.path`` itself. ``support.clusters`` holds the per-worker servers
(standalone cluster, Spark Connect, MLflow) that conftest.py hands out as session fixtures.
"""
