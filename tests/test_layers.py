"""The layers import downwards only: gguf_blocks (GGUF block formats, the QTensor leaf) imports
neither the kernels nor the engine; pallas_kernels imports gguf_blocks but nothing of rjax; and
no module of either names rjax anywhere, in a function body included (no hidden cycle)."""
from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules(package: str) -> list[str]:
    pkg = __import__(package)
    return [package] + [m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")]


@pytest.mark.parametrize("package, forbidden", [("gguf_blocks", ("rjax", "pallas_kernels")),
                                                ("pallas_kernels", ("rjax",))])
def test_importing_a_lower_layer_loads_nothing_above_it(package, forbidden):
    code = (f"import importlib, json, sys\n"
            f"for m in {_modules(package)!r}: importlib.import_module(m)\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {list(forbidden)!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("package, forbidden", [("gguf_blocks", ("rjax", "pallas_kernels")),
                                                ("pallas_kernels", ("rjax",))])
def test_no_import_of_a_higher_layer_anywhere_in_the_source(package, forbidden):
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in forbidden]
    assert found == []
