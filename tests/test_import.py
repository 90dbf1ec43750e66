"""`import sparktrain` works with neither torch nor TensorFlow importable."""
import subprocess
import sys


def test_import_without_frameworks():
    code = (
        "import sys\n"
        "for name in ('torch', 'tensorflow', 'horovod', 'keras'):\n"
        "    sys.modules[name] = None  # any import of it now raises ImportError\n"
        "import sparktrain\n"
        "from sparktrain import TorchEstimator, TorchModel, KerasEstimator, KerasModel, Store\n"
        "est = TorchEstimator(num_proc=2, feature_cols=['x'], batch_size=8)\n"
        "assert est.getBatchSize() == 8 and est.getBackend() == 'torch'\n"
        "assert KerasEstimator(num_proc=2).getBackend() == 'tensorflow'\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
