"""The interop matrix of docs/interop.md, generated from the tests that cover it.

Each test carrying ``@pytest.mark.interop(library, device, backends, mode)`` is a cell; the table lists
every cell with the tests that cover it. ``python docs/scripts/interop_matrix.py --write`` rewrites the
table between the markers of docs/interop.md; tests/test_interop_matrix.py checks that it is current.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "interop.md"
START, END = "<!-- interop-matrix:start -->", "<!-- interop-matrix:end -->"


def cells(tests_dir: Path = ROOT / "tests") -> dict:
    """{(library, device, backends, mode): [test ids]} from the interop marks of tests/test_*.py."""
    found: dict = {}
    for path in sorted(tests_dir.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.func.attr == "interop"):
                    key = tuple(ast.literal_eval(a) for a in deco.args)
                    found.setdefault(key, []).append(f"{path.name}::{node.name}")
    return found


def table() -> str:
    rows = ["| library | device | backends | autograd / jit / scheduler | covered by |", "|---|---|---|---|---|"]
    for (library, device, backends, mode), tests in sorted(cells().items()):
        rows.append(f"| {library} | {device} | {backends} | {mode} | {'<br>'.join(f'`{t}`' for t in tests)} |")
    return "\n".join(rows)


def page_with_table(text: str) -> str:
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    current = PAGE.read_text(encoding="utf-8")
    updated = page_with_table(current)
    if "--write" in sys.argv:
        PAGE.write_text(updated, encoding="utf-8")
    else:
        print(table())
    sys.exit(0)
