"""The layers of the library (``tidal``) and of its recipes (``tidal_recipes``, above it),
written down once: a module imports only its own layer and those below (so the library never
imports a recipe); no import cycles between modules (imports for type checking
included); imports inside functions only where a layer says why (the CLI keeps ``tidal
--help`` instant)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A package name covers its submodules.
LAYERS: list[tuple[str, ...]] = [
    ("tidal.units", "tidal.guard"),  # no tidal imports at all (guard: the storage guard's C++ seam)
    ("tidal.errors", "tidal.device"),
    ("tidal.memory", "tidal.timeline"),  # readings of device memory; a run's memory timeline
    ("tidal.transfer",),  # host arena, copy streams, staging
    ("tidal.vmm",),  # address-stable regions: CUDA virtual memory released and restored in place
    ("tidal.state",),  # a role's storages and the store that moves them
    ("tidal.timeshare", "tidal.optim", "tidal.activations", "tidal.plan"),  # the capabilities
    ("tidal.checkpoint", "tidal.distributed"),  # built on the capabilities
    ("tidal.integrations",),  # adapters for other trainers (TRL, transformers)
    ("tidal",),  # the public API: everything above is a recipe, never imported by the library
    ("tidal_recipes.measure",),  # models of the planner's shapes, the line rate: what benchmarks measure against
    ("tidal_recipes.grpo",),  # the GRPO reference loop and its toy task
    ("tidal_recipes.cli", "tidal_recipes.__main__", "tidal_recipes"),  # the command line
]
PACKAGES = ("tidal", "tidal_recipes")
# Where an import inside a function is the design, not a way around a cycle.
LAZY_OK = {"tidal_recipes.cli": "subcommands import their machinery when run, so `tidal --help` needs no torch"}


def _layer(module: str) -> int:
    best, depth = None, -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and name.count(".") > depth:
                best, depth = i, name.count(".")
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for path in (p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(n) for n in ast.walk(node))
    return ids


def _imports(modules: dict[str, Path], *, typing: bool = False) -> list[tuple[str, str, bool, int]]:
    """(importer, imported module, at top level, line) for every tidal import that runs;
    ``typing``: those under ``if TYPE_CHECKING:`` too."""
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = set() if typing else _type_checking_nodes(tree)
        top = {id(n) for n in tree.body}
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                # `from pkg import sub` imports the module pkg.sub when it is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                if any(t == p or t.startswith(p + ".") for p in PACKAGES):
                    out.append((name, t, id(node) in top, node.lineno))
    return out


def test_every_import_goes_down_the_layers():
    wrong = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)}) at line {line}"
        for a, b, _, line in _imports(_modules())
        if _layer(b) > _layer(a)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_imports_inside_functions_to_dodge_a_cycle():
    lazy = [
        f"{a} imports {b} inside a function (line {line})"
        for a, b, top, line in _imports(_modules())
        if not top and not any(a == p or a.startswith(p + ".") for p in LAZY_OK)
    ]
    assert not lazy, "\n".join(lazy)


def test_no_import_cycles():
    """Imports for type checking count too: a module that names another's type for its
    annotations depends on it as much as one that calls it (a protocol in a lower module,
    such as ``tidal.timeshare.core``, breaks such a circle)."""
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in _imports(_modules(), typing=True):
        if a != b and not a.startswith(b + "."):  # a package's own __init__ is not a cycle
            graph.setdefault(a, set()).add(b)
    # Tarjan's strongly connected components: any of two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
