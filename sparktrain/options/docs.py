"""The option tables of docs/usage.md, made from the declarations.

``python -m sparktrain.options.docs docs/usage.md`` rewrites the part of the file between
:data:`BEGIN` and :data:`END`; without a path it prints the tables. A test checks that the
file is current, so a new option shows up in the docs with its declaration.

Example::

    print(options_markdown())        # | option | TorchEstimator | KerasEstimator | ...
"""
from __future__ import annotations

import sys
from typing import Any, List, Sequence

from sparktrain.options.declarations import COMMON, KERAS, MODEL, TORCH, TORCH_MODEL, UNSET, Option

BEGIN = "<!-- options: made by `python -m sparktrain.options.docs docs/usage.md`, do not edit -->"
END = "<!-- end of options -->"


def _default(value: Any) -> str:
    return "(not set)" if value is UNSET else f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(groups: Sequence[Sequence[Option]], columns: Sequence[str]) -> List[str]:
    """One row per option name, marking which of ``groups`` (one per column) declare it."""
    names = list(dict.fromkeys(o.name for group in groups for o in group))
    rows = []
    for name in names:
        found = [next((o for o in group if o.name == name), None) for group in groups]
        declared = [o for o in found if o is not None]
        marks = ["yes" if o is not None else "" for o in found]
        spec = " / ".join(dict.fromkeys(f"`spec.{o.spec_name}`" for o in declared
                                        if o.spec_name))
        default = " / ".join(dict.fromkeys(_default(o.default) for o in declared))
        docs = " / ".join(dict.fromkeys(_cell(o.doc) for o in declared))
        rows.append(f"| `{name}` | " + " | ".join(marks) + f" | {default} | {spec} | {docs} |")
    header = "| option | " + " | ".join(columns) + " | default | on the ranks | what it does |"
    return [header, "|" + "---|" * (len(columns) + 4)] + rows


def options_markdown() -> str:
    """The estimators' and the models' option tables (markdown)."""
    estimators = _rows([COMMON + TORCH, COMMON + KERAS], ["TorchEstimator", "KerasEstimator"])
    models = _rows([MODEL + TORCH_MODEL, MODEL], ["TorchModel", "KerasModel"])
    return "\n".join(
        ["Every option is a constructor keyword, a Spark ML `Param` and a `getX`/`setX` pair "
         "(`X`: the name in CamelCase). Options marked *on the ranks* reach the rank loops' "
         "spec (`sparktrain.options.spec`) under that name.", "", "Estimators:", "", *estimators,
         "", "Models (`setX` on a fitted model; `TorchModel(...)` and `KerasModel(...)` take "
         "Horovod's constructor keywords):", "", *models])


def replace_section(text: str) -> str:
    """``text`` with its part between :data:`BEGIN` and :data:`END` made anew."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return f"{text[:start]}\n{options_markdown()}\n{text[end:]}"


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(options_markdown())
        return 0
    with open(argv[0]) as f:
        text = f.read()
    with open(argv[0], "w") as f:
        f.write(replace_section(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
