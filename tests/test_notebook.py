"""notebooks/quickstart.ipynb (numeric digits, then the same digits as PNG files) runs top
to bottom (nbclient, a real kernel); any failing cell fails the build.

Full tier: only this test runs the notebook, so only it catches a quick-start cell broken by an
API change, a fit that cannot run in a Jupyter kernel, or plot_history() showing no figure."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.full
def test_quickstart_notebook_runs():
    import nbformat
    from nbclient import NotebookClient

    path = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                      for o in cell.get("outputs", []))
    assert "test accuracy:" in outputs and "reloaded model's test accuracy:" in outputs
    # section 6: a binaryFile DataFrame of PNGs, decoded in worker processes, saved and reloaded
    assert "image test accuracy:" in outputs and "reloaded image model's test accuracy:" in outputs
    images = [o for cell in notebook.cells for o in cell.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "plot_history() showed no figure"
