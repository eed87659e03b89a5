"""The package map of docs/architecture.md, enforced: imports flow one way
(cli -> studies and sweeps -> mcp -> probe framework, service, client -> wire -> memory, eviction -> data
path, models, stats), no import cycle, and no module
imports another's private name. Imports inside functions and under ``TYPE_CHECKING`` count too.
The map lists every module once, with its layer. Also runs the runnable examples in the data path's
docstrings."""

import ast
import doctest
import importlib
import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
DOC = SRC.parent / "docs" / "architecture.md"

#: a module may import modules of its own layer or a lower one (docs/architecture.md, "The import rule")
LAYERS = (
    ("eventkv", "eventkv.errors", "eventkv.files"),
    ("eventkv.options", "eventkv.stats"),
    ("eventkv.models", "eventkv.kv", "eventkv.testing"),
    ("eventkv.memory", "eventkv.eviction"),
    ("eventkv.wire",),
    ("eventkv.client", "eventkv.service", "eventkv.probes"),
    ("eventkv.mcp",),
    ("eventkv.studies", "eventkv.sweep"),
    ("eventkv.cli",),
)
#: sibling packages of one layer that must not import each other: the studies, and the product's
#: surfaces (service, client) vs the probe framework
INDEPENDENT = (
    ("eventkv.studies.materialization", "eventkv.studies.splice"),
    ("eventkv.service", "eventkv.probes"),
    ("eventkv.client", "eventkv.probes"),
    ("eventkv.client", "eventkv.service"),
    ("eventkv.mcp", "eventkv.probes"),
)
#: the product: no module of these imports a study
PRODUCT = ("eventkv.memory", "eventkv.eviction", "eventkv.service", "eventkv.client", "eventkv.wire", "eventkv.mcp")


def _modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "eventkv").rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, str | None]]:
    """``(imported module, imported name or None)`` for every eventkv import in module ``name``."""
    f = MODULES[name]
    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = importlib.util.resolve_name("." * node.level + base, package)
            if not base.startswith("eventkv"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, None) if sub in MODULES else (base, alias.name))
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("eventkv")]
    return out


def _known(module: str) -> str:
    """The longest prefix of ``module`` that is one of our modules."""
    while module not in MODULES:
        module = module.rpartition(".")[0]
    return module


GRAPH = {m: {_known(i) for i, _ in _imports(m)} - {m} for m in MODULES}


def _layer(module: str) -> int:
    best = max((p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def test_every_module_has_a_layer():
    assert {m: _layer(m) for m in MODULES}


def test_no_upward_import():
    upward = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in GRAPH.items()
        for d in deps
        if _layer(d) > _layer(m) and not d.startswith(m + ".")  # a package's __init__ may expose its modules
    ]
    assert upward == []


def test_studies_do_not_import_each_other():
    crossing = [
        f"{m} imports {d}"
        for a, b in INDEPENDENT
        for m, deps in GRAPH.items()
        for d in deps
        if (m.startswith(a) and d.startswith(b)) or (m.startswith(b) and d.startswith(a))
    ]
    assert crossing == []


def test_product_imports_no_study():
    studying = [
        f"{m} imports {d}"
        for m, deps in GRAPH.items()
        if m.startswith(PRODUCT) or _layer(m) <= _layer("eventkv.memory")
        for d in deps
        if d.startswith(("eventkv.studies", "eventkv.probes"))
    ]
    assert studying == []


def test_no_import_cycle():
    """Tarjan's strongly connected components over the module graph: none larger than one module."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_private_cross_module_import():
    private = [
        f"{m} imports {name} from {mod}"
        for m in MODULES
        for mod, name in _imports(m)
        if name and name.startswith("_") and not name.startswith("__") and mod != m
    ]
    assert private == []


#: a module row of docs/architecture.md: ``| `path relative to src/eventkv` | layer | job |``
MAP_ROW = re.compile(r"^\|\s*`([^`|]*(?:\.py|/))`\s*\|([^|]*)\|", re.MULTILINE)


def _mapped(path: str) -> str:
    """The module a map row names: ``memory/rerank.py`` is ``eventkv.memory.rerank``; a package is its
    ``__init__.py`` (``memory/__init__.py``, the top package's ``__init__.py``) or its folder (``memory/``)."""
    parts = ["eventkv", *path.removesuffix(".py").strip("/").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_package_map_lists_every_module_once():
    """docs/architecture.md's package map (every table row whose first cell is a backticked path
    ending in ``.py`` or ``/``): every module of src/eventkv has exactly one row, every row names a
    module, and each row's layer column is the module's layer in ``LAYERS``."""
    rows = [(_mapped(path), path, layer.strip()) for path, layer in MAP_ROW.findall(DOC.read_text())]
    count = Counter(m for m, _, _ in rows)
    wrong = [f"{MODULES[m].relative_to(SRC / 'eventkv')}: not in the map" for m in sorted(MODULES.keys() - count)]
    wrong += [f"`{path}`: no such module" for m, path, _ in rows if m not in MODULES]
    wrong += [f"{m}: listed {n} times" for m, n in count.items() if n > 1]
    wrong += [
        f"`{path}`: layer {layer!r}, but {m} is in layer {_layer(m)}"
        for m, path, layer in rows
        if m in MODULES and layer != str(_layer(m))
    ]
    assert wrong == []


@pytest.mark.parametrize("module", ["eventkv.kv.prefill", "eventkv.kv.serve"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
