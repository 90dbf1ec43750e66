"""Every sparktrain name the code's docstrings and the docs mention exists.

Static (no import, no Spark): a dotted ``sparktrain.x.y`` name, and the target of every
``:mod:``/``:class:``/``:func:``/... role, resolves when its module's file exists and the module
(or a class in it) defines or imports the rest at its top level. CHANGELOG.md is left out: it
names old modules on purpose.
"""
from __future__ import annotations

import ast
import builtins
import json
import pathlib
import re
from typing import Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sparktrain"
SUFFIXES = (".py", ".md", ".conf", ".ipynb", ".sh", ".cfg", ".toml", ".ini")
FOLDERS = ("sparktrain", "tests", "bench", "jobs", "docs", "conf", "notebooks", "scripts")
ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj):`([^`]+)`")
DOTTED = re.compile(r"(?<![\w./-])sparktrain(?:\.[A-Za-z_]\w*)+")
#: ``sparktrain.*`` names that are not Python: Spark conf keys, loggers, MLflow tags and params
NOT_PYTHON = re.compile(
    r"^sparktrain\.(leaseSeconds|slotWaitSeconds|progressIntervalSeconds|elastic\.\w+|rank|"
    r"test|state|tuning|version(\.\w+)?|no\.such\.key|run_id|num_proc|estimator|engine|"
    r"strategy|outcome|error|preflight|attempts|resumed_from_epoch|store_run_path|"
    r"model_uri(\.\w+)?)$")
#: role targets outside sparktrain
FOREIGN = ("keras", "torch", "pyspark", "tf", "horovod", "mlflow.", "numpy", "pyarrow")

_TREES: Dict[pathlib.Path, ast.Module] = {}


def _module_file(name: str) -> Optional[pathlib.Path]:
    path = ROOT / name.replace(".", "/")
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _tree(path: pathlib.Path) -> ast.Module:
    if path not in _TREES:
        _TREES[path] = ast.parse(path.read_text())
    return _TREES[path]


def _names(body: List[ast.stmt]) -> Dict[str, ast.AST]:
    """The names a module or class body defines, assigns or imports (also under if/try)."""
    found: Dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            found.update((n.id, node) for target in node.targets for n in ast.walk(target)
                         if isinstance(n, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and \
                isinstance(node.target, ast.Name):
            found[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(((a.asname or a.name).split(".")[0], node) for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", [])):
                found.update(_names(block))
            for handler in getattr(node, "handlers", []):
                found.update(_names(handler.body))
    return found


def _lazy(path: pathlib.Path) -> set:
    """A module with ``__getattr__`` (lazy exports): the strings it holds may be attributes."""
    tree = _tree(path)
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        return set()
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def resolves(dotted: str) -> bool:
    """``sparktrain.a.b.C.m`` names a module, or something a module (or its class) defines."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        scope = _names(_tree(path).body)
        if rest[0] not in scope:
            return rest[0] in _lazy(path)
        node = scope[rest[0]]
        for attr in rest[1:]:
            if not isinstance(node, ast.ClassDef):
                return True  # an attribute of an imported or assigned object: not checked
            inner = _names(node.body)
            if attr not in inner:
                return False
            node = inner[attr]
        return True
    return False


def _candidates(target: str, module: str) -> Optional[List[str]]:
    """Full names a role target may mean in ``module`` (Sphinx looks in the module, then up)."""
    target = target.strip().lstrip("~!").rstrip("()")
    if target.startswith("sparktrain"):
        return [target]
    if not module or (not target.startswith(".") and target in dir(builtins)):
        return None
    parts = module.split(".")
    dot = "" if target.startswith(".") else "."
    return [".".join(parts[:cut]) + dot + target for cut in range(len(parts), 0, -1)]


def _in_a_class(name: str, module: str) -> bool:
    """A bare ``:meth:``/``:attr:`` target: some class of ``module`` defines it."""
    path = _module_file(module)
    return path is not None and any(isinstance(node, ast.ClassDef) and name in _names(node.body)
                                    for node in ast.walk(_tree(path)))


def _files() -> List[pathlib.Path]:
    """The package, its tests, benchmarks, entry points, docs and scripts (not this file)."""
    found = [p for p in ROOT.glob("*") if p.suffix in SUFFIXES and p.name != "CHANGELOG.md"]
    for folder in FOLDERS:
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES
                  and "__pycache__" not in p.parts and p != pathlib.Path(__file__).resolve()]
    return sorted(p for p in found if p.is_file())


def _text(path: pathlib.Path) -> str:
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell.get("source", "")) for cell in json.loads(text)["cells"])
    return text


def stale_names() -> List[str]:
    bad = []
    for path in _files():
        module = ""
        if path.suffix == ".py" and PACKAGE in path.parents:
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for number, line in enumerate(_text(path).splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            for match in ROLE.finditer(line):
                target = match.group(1)
                bare = target.lstrip("~").rstrip("()")
                candidates = _candidates(target, module)
                if target.startswith(FOREIGN) or candidates is None or \
                        ("." not in bare and _in_a_class(bare, module)):
                    continue
                if not any(resolves(name) for name in candidates):
                    bad.append(f"{where}: {match.group(0)}")
            bad += [f"{where}: {match.group(0)}" for match in DOTTED.finditer(line)
                    if not NOT_PYTHON.match(match.group(0)) and not resolves(match.group(0))]
    return bad


def test_every_named_module_and_object_exists():
    bad = stale_names()
    assert not bad, "names of modules or objects that do not exist:\n" + "\n".join(bad)


def test_the_check_finds_a_stale_name():
    assert resolves("sparktrain.loop.callbacks.Callback")
    assert resolves("sparktrain.TorchEstimator")  # a lazy export
    assert not resolves("sparktrain.estimators.keras_worker")
    assert not resolves("sparktrain.loop.callbacks.NoSuchCallback")
