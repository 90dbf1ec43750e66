"""`import sparktrain` works with neither torch nor TensorFlow importable."""
import ast
import pathlib
import subprocess
import sys


def test_import_without_frameworks():
    """Every public name imports with no framework (nor MLflow) importable, and only then."""
    code = (
        "import sys\n"
        "for name in ('torch', 'tensorflow', 'horovod', 'keras', 'mlflow'):\n"
        "    sys.modules[name] = None  # any import of it now raises ImportError\n"
        "import sparktrain\n"
        "assert not [m for m in sys.modules if m.startswith('sparktrain.')], 'imported eagerly'\n"
        "for name in sparktrain.__all__:\n"
        "    exec(f'from sparktrain import {name}')\n"
        "    assert getattr(sparktrain, name).__name__ == name, name\n"
        "assert set(sparktrain.__all__) <= set(dir(sparktrain))\n"
        "from sparktrain import TorchEstimator, KerasEstimator\n"
        "est = TorchEstimator(num_proc=2, feature_cols=['x'], batch_size=8)\n"
        "assert est.getBatchSize() == 8 and est.getBackend() == 'torch'\n"
        "assert KerasEstimator(num_proc=2).getBackend() == 'tensorflow'\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- the import graph ------------------------------------------------------------------------------

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


def _type_checking_only(tree):
    """The ids of the nodes inside ``if TYPE_CHECKING:`` blocks (for type checkers: never run)."""
    return {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
            and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for statement in node.body for inner in ast.walk(statement)}


def _imports(name, path, runtime_only=False):
    """Every module ``name`` imports, at the top or inside a function (both run on a rank);
    with ``runtime_only``, not those in ``if TYPE_CHECKING:`` blocks."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    names = set()
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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
        # the package's exports are imported lazily (__getattr__); its TYPE_CHECKING block
        # names them for type checkers only
        found = _imports(name, path, runtime_only=name == PACKAGE_ROOT)
        edges[name] = {m for m in found if m in modules and m != name}
        edges[name] |= {m for m in found if m.startswith("pyspark.ml")}
    return modules, edges


def test_type_checkers_see_every_export():
    """The package's ``if TYPE_CHECKING:`` block imports each public name from the module
    ``_EXPORTS`` says (what type checkers and IDEs see of the lazy exports)."""
    import sparktrain

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    skipped = _type_checking_only(tree)
    seen = {alias.asname or alias.name: node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and id(node) in skipped for alias in node.names}
    assert seen == sparktrain._EXPORTS


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
#: low to high (issues #26, #36, #43): a module imports its own layer and those below it, never
#: one above. Each entry is a package or a top-level module, never a module inside a package (a
#: reader sees the folders); a new package or top-level module must be placed here.
LAYERS = (
    ("foundation", ("sparktrain.errors", "sparktrain.faults", "sparktrain.fs",
                    "sparktrain.fork_safety", "sparktrain.sockets",
                    "sparktrain.plugins", "sparktrain.pickling", "sparktrain.model_files",
                    "sparktrain.fit_hooks")),
    # every option declared once, and made from them the specs (and beside them the payloads)
    # the ranks get
    ("options", ("sparktrain.options",)),
    ("session", ("sparktrain.session",)),
    ("data", ("sparktrain.data",)),
    ("launch", ("sparktrain.launch",)),
    ("strategies", ("sparktrain.strategies",)),
    ("rank loops", ("sparktrain.loop",)),
    ("estimators", ("sparktrain.estimators",)),
    # a fitted language model's text over a DataFrame: a transformer beside the models
    ("generation", ("sparktrain.generation",)),
    ("plug-ins", ("sparktrain.mlflow",)),
)
#: the package itself: its exports are imported lazily (``__getattr__``), so any layer may
#: import it (``import sparktrain`` for its path)
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


# -- the packages --------------------------------------------------------------------------------
def _package(name):
    """The package (``sparktrain.data``) or top-level module (``sparktrain.fs``) of ``name``."""
    return ".".join(name.split(".")[:2])


def _package_graph():
    """``{package: {package it imports: one module import that shows it}}``, the root left out
    (its exports are lazy)."""
    modules, edges = _graph()
    graph = {}
    for name in sorted(modules):
        for target in sorted(edges[name]):
            if PACKAGE_ROOT in (name, target) or target not in modules:
                continue
            source, imported = _package(name), _package(target)
            if source != imported:
                graph.setdefault(source, {}).setdefault(imported, f"{name} -> {target}")
    return graph


def test_layers_name_packages_and_top_level_modules_only():
    modules = _modules()
    entries = [prefix for _, prefixes in LAYERS for prefix in prefixes]
    wrong = [p for p in entries if p not in modules or _package(p) != p]
    assert not wrong, f"LAYERS lists modules inside a package (list their package): {wrong}"
    assert len(entries) == len(set(entries)), "a package is in two layers"


def test_packages_import_down_and_never_in_a_circle():
    """Counted by package, as a reader sees the folders: no import runs up a layer, and no
    two packages import each other, directly or through others (a module inside a package
    does not get a layer of its own to make it pass)."""
    graph = _package_graph()
    upward = [f"{source} ({_layer(source)[1]}) imports {target} ({_layer(target)[1]}): {example}"
              for source, targets in sorted(graph.items())
              for target, example in sorted(targets.items())
              if _layer(target)[0] > _layer(source)[0]]
    assert not upward, "packages importing up:\n" + "\n".join(upward)
    circles = []

    def visit(package, path, done):
        for target in sorted(graph.get(package, ())):
            if target in path:
                loop = path[path.index(target):] + [target]
                circles.append(" -> ".join(loop) + "  (" + "; ".join(
                    graph[a][b] for a, b in zip(loop, loop[1:], strict=False)) + ")")
            elif target not in done:
                visit(target, path + [target], done)
        done.add(package)

    done = set()
    for package in sorted(graph):
        visit(package, [package], done)
    assert not circles, "package circles:\n" + "\n".join(circles)
