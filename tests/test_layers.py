"""The import structure of rjax, gguf_blocks and pallas_kernels: every module belongs to one
layer of `LAYERS`, and imports only modules of its own layer or of the layers below it; the
kernels are reached only from the math layer, which decides which kernel runs; and no modules
import each other in a circle. Imports are read from the source with `ast`, at module level
and in function bodies alike, so this test imports nothing of the code it checks."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gguf_blocks", "pallas_kernels", "rjax")

# Lowest first. A name stands for that module; a name ending in ".*" for every module of a package.
LAYERS: dict[str, tuple[str, ...]] = {
    # GGUF block formats and the QTensor leaf that kernels and engine share.
    "blocks": ("gguf_blocks.*",),
    # Pallas GPU kernels beside the pure-JAX references that define them.
    "kernels": ("pallas_kernels.*",),
    # Pure functions over static configs and pytrees: what is computed, and by which kernel.
    "math": ("rjax.math.*",),
    # Model names and files -> config, params and tokenizer; stored programs.
    "loading": ("rjax.loading.*",),
    # The jitted device programs (prefill, decode loops, slot batches, speculative rounds), their
    # compilation, and what they need of the device's memory and bandwidth.
    "engine": ("rjax.engine.*",),
    # Host-side runtime over the programs: requests checked, scheduled, streamed; the public facade.
    "runtime": ("rjax", "rjax.runtime.*"),
    # The HTTP server.
    "server": ("rjax.server.*",),
    # The `rjax` command, `rjax serve` included.
    "cli": ("rjax.cli.*",),
}
# A layer that only the layer named may import: the plan, ops and caches choose the kernels, so
# nothing above them names a kernel.
PRIVATE_TO = {"kernels": "math"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


SOURCES = _sources()


def _layer_of(module: str) -> str | None:
    found = [layer for layer, names in LAYERS.items()
             if module in names or any(n.endswith(".*") and (module + ".").startswith(n[:-1]) for n in names)]
    assert len(found) <= 1, f"{module} is in more than one layer: {found}"
    return found[0] if found else None


def _resolve(name: str) -> str | None:
    """The module a dotted name refers to: itself, or the module that defines it (a name in it)."""
    while name and name not in SOURCES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, int]]:
    """(imported module of these packages, line) for every import statement anywhere in `module`."""
    path = SOURCES[module]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            # `from a import b`: the module a.b where there is one, else a name defined in a.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES and (target := _resolve(name)) not in (None, module):
                found.append((target, node.lineno))
    return found


GRAPH = {m: _imports(m) for m in SOURCES}
ORDER = list(LAYERS)


def test_every_module_has_one_layer():
    assert [m for m in SOURCES if _layer_of(m) is None] == [], "modules without a layer: add them to LAYERS"
    stale = [n for names in LAYERS.values() for n in names if not n.endswith(".*") and n not in SOURCES]
    assert stale == [], "LAYERS names modules that do not exist"


def test_imports_go_down_the_layers_only():
    wrong = []
    for module, imports in GRAPH.items():
        mine = _layer_of(module)
        for target, line in imports:
            theirs = _layer_of(target)
            if ORDER.index(theirs) > ORDER.index(mine) or mine not in (theirs, PRIVATE_TO.get(theirs, mine)):
                wrong.append(f"{SOURCES[module].relative_to(ROOT)}:{line} ({mine}) imports {target} ({theirs})")
    assert wrong == [], "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_reading_of_imports_finds_them():
    """The checks above see every form of import: `from a import b`, `import a.b`, relative, and
    in a function body; and a circle is found as one."""
    edges = {m: {t for t, _ in imports} for m, imports in GRAPH.items()}
    assert {"rjax.math.ops", "rjax.math.params", "rjax.math.plan"} <= edges["rjax.math.model"]
    assert "rjax.loading.tokenizer" in edges["rjax.loading.loaders"]              # in `load`'s body
    assert "pallas_kernels.attention.decode" in edges["pallas_kernels.attention"]  # `from .decode import`
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = _cycles({m: {t for t, _ in imports} for m, imports in GRAPH.items()})
    assert cycles == [], "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_only_the_facade_imports_by_name():
    """`rjax/__init__.py` imports its exports on first use by name; a module anywhere else that
    imported by a computed name would hide an import from the checks above."""
    dynamic = []
    for module, path in SOURCES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and module != "rjax" and (
                    (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                    or (isinstance(node.func, ast.Name) and node.func.id == "__import__")):
                dynamic.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert dynamic == []


def test_the_facade_exports_only_from_the_layers_below_the_server_and_cli():
    tree = ast.parse(SOURCES["rjax"].read_text(encoding="utf-8"))
    exports = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                   and [getattr(t, "id", None) for t in node.targets] == ["_EXPORTS"])
    modules = ast.literal_eval(exports).keys()
    assert [m for m in modules if ORDER.index(_layer_of(m)) > ORDER.index("runtime")
            or _layer_of(m) == "kernels"] == []


def _short_names(layer: str) -> set[str]:
    """How a test file names the modules of `layer`: the dotted name below the layer's package,
    joined by "_" (pallas_kernels.attention.decode -> attention_decode, rjax.math.cache -> cache,
    rjax.loading.loaders.gguf -> loaders_gguf); a module named on its own by its last name (rjax)."""
    short = set()
    for module in (m for m in SOURCES if _layer_of(m) == layer):
        packages = [n[:-2] for n in LAYERS[layer] if n.endswith(".*") and (module + ".").startswith(n[:-1])]
        rest = module.removeprefix(packages[0]).lstrip(".") if packages else module.rpartition(".")[2]
        short |= {rest.replace(".", "_")} - {""}
    return short


# The test files that stay at the top of tests/: they check no one module but the whole.
CROSS_CUTTING = ("test_layers.py", "test_gpu_smoke.py", "test_notebooks.py", "test_oracle.py")


def test_the_tests_mirror_the_layers():
    """tests/<layer>/test_<module>[_<aspect>].py: every test file in a layer's folder names a
    module of that layer, no folder of tests/ holds test files but is not a layer, and only the
    cross-cutting checks stay at the top."""
    tests = ROOT / "tests"
    top = {p.name for p in tests.glob("test_*.py")} - set(CROSS_CUTTING)
    wrong = [f"tests/{name}: a test of one module goes in tests/<layer>/" for name in sorted(top)]
    for path in sorted(tests.glob("*/test_*.py")):
        layer, stem = path.parent.name, path.stem.removeprefix("test_")
        if layer not in LAYERS:
            wrong.append(f"{path.relative_to(ROOT)}: {layer} is not a layer")
        elif not any(stem == n or stem.startswith(n + "_") for n in _short_names(layer)):
            wrong.append(f"{path.relative_to(ROOT)}: names no module of the {layer} layer")
    assert wrong == [], "\n".join(wrong)
