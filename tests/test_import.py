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


# -- the import graph ------------------------------------------------------------------------------
import ast  # noqa: E402
import pathlib  # noqa: E402

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "sparktrain"
#: the modules that run inside barrier tasks and their child processes
RANK_SIDE = ("sparktrain.loop", "sparktrain.strategies", "sparktrain.launch")
ESTIMATOR_MODULES = {"sparktrain.estimators.torch", "sparktrain.estimators.torch_model",
                     "sparktrain.estimators.keras", "sparktrain.estimators.model",
                     "sparktrain.estimators.base", "sparktrain.estimators.preflight"}


def _modules():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name, path):
    """Every module ``name`` imports, at the top or inside a function (both run on a rank)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _graph():
    modules = _modules()
    edges = {}
    for name, path in modules.items():
        found = _imports(name, path)
        edges[name] = {m for m in found if m in modules and m != name}
        edges[name] |= {m for m in found if m.startswith("pyspark.ml")}
    return modules, edges


def test_no_import_circles():
    modules, edges = _graph()
    circles = []

    def visit(name, path, done):
        for target in sorted(edges.get(name, ())):
            if target in path:
                circles.append(path[path.index(target):] + [target])
            elif target in modules and target not in done:
                visit(target, path + [target], done)
        done.add(name)

    done = set()
    for name in sorted(modules):
        visit(name, [name], done)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_rank_side_code_never_imports_an_estimator_or_pyspark_ml():
    modules, edges = _graph()
    offenders = []
    for start in sorted(m for m in modules if m.startswith(RANK_SIDE)):
        seen, stack = set(), [(start, [start])]
        while stack:
            name, path = stack.pop()
            for target in edges.get(name, ()):
                if target in ESTIMATOR_MODULES or target.startswith("pyspark.ml"):
                    offenders.append(" -> ".join(path + [target]))
                elif target not in seen and target in modules:
                    seen.add(target)
                    stack.append((target, path + [target]))
    assert not offenders, "\n".join(offenders)


# -- the layers ------------------------------------------------------------------------------------
#: low to high (issues #26, #36): a module imports its own layer and those below it, never one above.
#: A module is in the layer of its longest matching prefix; a new module must be placed here.
LAYERS = (
    ("foundation", ("sparktrain.errors", "sparktrain.faults", "sparktrain.fs",
                    "sparktrain.plugins", "sparktrain.pickling", "sparktrain.model_files",
                    "sparktrain.fit_hooks")),
    # every option declared once, and the specs the rank loops get from them
    ("options", ("sparktrain.options", "sparktrain.loop.spec")),
    ("session", ("sparktrain.session",)),
    ("data", ("sparktrain.data",)),
    ("launch", ("sparktrain.launch",)),
    ("rank loops and strategies", ("sparktrain.loop", "sparktrain.strategies")),
    ("estimators", ("sparktrain.estimators",)),
    ("plug-ins", ("sparktrain.mlflow",)),
)
#: the package itself: its exports are imported lazily (``__getattr__``), so any layer may
#: import it (``from sparktrain import compat``, ``import sparktrain`` for its path)
PACKAGE_ROOT = "sparktrain"


def _layer(name):
    """``(rank, layer name)`` of module ``name``, or ``None`` if no layer claims it."""
    best = None
    for rank, (layer, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and \
                    (best is None or len(prefix) > best[2]):
                best = (rank, layer, len(prefix))
    return best and best[:2]


def test_every_module_has_a_layer():
    modules, edges = _graph()
    assert not edges[PACKAGE_ROOT], f"importing the package imports {sorted(edges[PACKAGE_ROOT])}"
    unplaced = sorted(m for m in modules if m != PACKAGE_ROOT and _layer(m) is None)
    assert not unplaced, f"place these modules in LAYERS (tests/test_import.py): {unplaced}"


def test_imports_never_go_up_a_layer():
    modules, edges = _graph()
    upward = []
    for name in sorted(modules):
        if name == PACKAGE_ROOT or _layer(name) is None:
            continue
        rank, layer = _layer(name)
        for target in sorted(t for t in edges[name] if t in modules and t != PACKAGE_ROOT):
            target_rank, target_layer = _layer(target) or (0, "?")
            if target_rank > rank:
                upward.append(f"{name} ({layer}) imports {target} ({target_layer})")
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_low_layers_and_the_base_estimator_import_no_estimator_or_plugin():
    """The rules issue #26 names, spelled out: data, launch and fs import no estimator and no
    MLflow; the base estimator reaches MLflow only through the fit hooks."""
    modules, edges = _graph()
    low = [m for m in modules if m.startswith(("sparktrain.data", "sparktrain.launch"))
           or m in ("sparktrain.fs", "sparktrain.errors", "sparktrain.fit_hooks")]
    offenders = [f"{m} -> {t}" for m in sorted(low) for t in sorted(edges[m])
                 if t.startswith(("sparktrain.estimators", "sparktrain.mlflow"))]
    offenders += [f"sparktrain.estimators.base -> {t}"
                  for t in sorted(edges["sparktrain.estimators.base"])
                  if t.startswith("sparktrain.mlflow")]
    assert not offenders, "\n".join(offenders)
