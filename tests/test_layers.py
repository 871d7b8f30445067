"""The package's layers import one way (docs/architecture.md): a module may import its own layer and the
layers below it, never one above. Checked over the source with ``ast`` (lazy imports inside functions
count too), so a new import that turns the arrow around fails here before it becomes a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rotary"

#: bottom (0) to top: what each layer is, in the order imports may point (down only)
LAYERS = [
    ("backends", ("rotary.backends",)),
    ("spec", ("rotary.spec", "rotary.testing")),
    ("frontend", ("rotary.frontend",)),
    ("attention", ("rotary.attn", "rotary.kvcache")),
    ("interop", ("rotary.interop",)),
    ("public API", ("rotary",)),
    ("conformance and CLI", ("rotary.conformance", "rotary.cli")),
    ("entry point", ("rotary.__main__",)),
]


def layer_of(module: str) -> int:
    """The layer of a dotted module name: the longest matching prefix decides."""
    best, best_len = None, -1
    for level, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = level, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return best


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str | None = None, root: Path = PACKAGE.parent):
    """(imported module, line) for every import of rotary's own modules in ``path`` (module ``module``;
    ``root`` the folder holding the package)."""
    module = module or module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "rotary":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "rotary":
                continue
            for alias in node.names:   # `from . import spec` imports the submodule rotary.spec
                sub = f"{target}.{alias.name}"
                yield (sub if (root / sub.replace(".", "/")).exists()
                       or (root / (sub.replace(".", "/") + ".py")).exists() else target), node.lineno


def test_every_module_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_imports_point_down_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_name(path)
        for target, line in imports_of(path):
            if layer_of(target) > layer_of(here):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {here} ({LAYERS[layer_of(here)][0]}) "
                              f"imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def upward_imports(path: Path, module: str) -> list:
    return [target for target, _ in imports_of(path, module) if layer_of(target) > layer_of(module)]


def test_the_check_sees_upward_imports(tmp_path):
    """The checker itself: a spec module importing the frontend (relative, absolute, lazy) is reported;
    one importing its own layer and the backends is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ..frontend.rotate import apply\nimport rotary.attn.linear\n"
                     "def f():\n    from ..interop import torch_adapter\n")
    assert upward_imports(probe, "rotary.spec.probe") == ["rotary.frontend.rotate", "rotary.attn.linear",
                                                          "rotary.interop.torch_adapter"]
    probe.write_text("from . import tables\nfrom .. import backends\nfrom .validators import as_int\n")
    assert upward_imports(probe, "rotary.spec.probe") == []


@pytest.mark.parametrize("name", ["rotary.backends.numba", "rotary.spec.tables", "rotary.frontend.normalize"])
def test_lower_layers_never_import_the_public_package(name):
    path = PACKAGE.parent / (name.replace(".", "/") + ".py")
    assert "rotary" not in {t for t, _ in imports_of(path)}


def import_graph(package: Path = PACKAGE) -> dict:
    """{module: {rotary modules it imports}} over every module of ``package`` (module-level and lazy
    imports); an imported name that is no module of its own counts as its module (``from .x import f``)."""
    modules = {module_name(p, package.parent): p for p in package.rglob("*.py")}
    graph = {}
    for here, path in modules.items():
        targets = set()
        for target, _ in imports_of(path, here, package.parent):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target != here:
                targets.add(target)
        graph[here] = targets
    return graph


def import_cycles(graph: dict) -> list:
    """The import circles of ``graph``: its strongly connected components of more than one module
    (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_circle():
    """No module of rotary imports, directly or through others, a module that imports it back (lazy
    imports inside functions included: they only hide a circle). rotary/spec had one (rope_spec ->
    hf_vision -> rope_spec): hf_vision now takes the spec class as an argument."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_check_sees_import_circles(tmp_path):
    """The checker itself: a lazy import back (b imports a inside a function) is a circle, a one-way chain
    is not."""
    pkg = tmp_path / "rotary"
    (pkg / "spec").mkdir(parents=True)
    for name in ("__init__.py", "spec/__init__.py"):
        (pkg / name).write_text("")
    (pkg / "spec" / "a.py").write_text("from . import b\nfrom .c import f\n")
    (pkg / "spec" / "b.py").write_text("def g():\n    from .a import h\n")
    (pkg / "spec" / "c.py").write_text("import numpy\n")
    graph = import_graph(pkg)
    assert graph["rotary.spec.a"] == {"rotary.spec.b", "rotary.spec.c"}
    assert import_cycles(graph) == [["rotary.spec.a", "rotary.spec.b"]]
    (pkg / "spec" / "b.py").write_text("from . import c\n")
    assert import_cycles(import_graph(pkg)) == []
