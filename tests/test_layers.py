"""The package's layers import in one direction only, and ``import specsplit`` stays light.

Layers, lowest first (DESIGN.md, "Layout"): errors and telemetry; core (pure tensor algorithms);
config; messages and models; runtime; engines; transport; pipeline; local and remote; generator;
the package's public API; cli; bench. A module may import its own package or a lower layer, never a
higher one; every ``import specsplit...`` line counts, including those inside functions and under
``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specsplit"

# (module prefix, layer); the longest matching prefix decides.
LAYERS: tuple[tuple[str, int], ...] = (
    ("specsplit.errors", 0),
    ("specsplit.telemetry", 0),
    ("specsplit.core", 1),
    ("specsplit.config", 2),
    ("specsplit.messages", 3),
    ("specsplit.models", 3),
    ("specsplit.runtime", 4),
    ("specsplit.engines", 5),
    ("specsplit.transport", 6),
    ("specsplit.pipeline", 7),
    ("specsplit.local", 8),
    ("specsplit.remote", 8),
    ("specsplit.generator", 9),
    ("specsplit", 10),  # the package's own __init__: the public API
    ("specsplit.cli", 11),
    ("specsplit.bench", 12),
)


def layer_of(module: str) -> tuple[int, str]:
    """``(layer, owning prefix)`` of a ``specsplit`` module."""
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best], best


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``specsplit`` import in ``source`` (functions and TYPE_CHECKING too)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "specsplit"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "specsplit":
                # `from specsplit.x import y`: y may itself be a module of x
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def upward_imports(module: str, source: str) -> list[str]:
    """Imports of ``module`` (with source ``source``) that reach a higher layer than its own."""
    mine, my_pkg = layer_of(module)
    bad = []
    for line, target in imported_modules(source):
        theirs, their_pkg = layer_of(target)
        if their_pkg == my_pkg:
            continue  # inside one package
        if theirs >= mine:
            bad.append(f"{module}:{line} imports {target} (layer {theirs} >= {mine})")
    return bad


def test_no_module_imports_a_higher_layer() -> None:
    files = sorted(p for p in PACKAGE.rglob("*.py") if "_generated" not in p.parts)
    assert len(files) > 40
    bad = [msg for f in files for msg in upward_imports(module_name(f), f.read_text(encoding="utf-8"))]
    assert not bad, "upward imports:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "module, source, flagged",
    [
        ("specsplit.core.tree", "from specsplit.engines.draft import DraftEngine\n", True),
        ("specsplit.engines.draft", "def f():\n    from specsplit.pipeline import decode\n", True),
        (
            "specsplit.engines.target",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from specsplit.generator import SpecSplitGenerator\n",
            True,
        ),  # fmt: skip
        ("specsplit.runtime.graphs", "from specsplit import TokenTree\n", True),  # the public API is high
        ("specsplit.local.transport", "import specsplit.remote\n", True),  # siblings stay apart
        ("specsplit.engines.draft", "from specsplit.core.tree import TokenTree\n", False),
        ("specsplit.engines.draft", "from specsplit.engines.base import EngineBase\n", False),
        ("specsplit.generator", "from specsplit.remote import GrpcTransport\n", False),
    ],
)
def test_the_check_flags_upward_imports(module: str, source: str, flagged: bool) -> None:
    assert bool(upward_imports(module, source)) is flagged


def test_import_specsplit_loads_no_bench_and_no_grpc() -> None:
    code = (
        "import sys, specsplit\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('specsplit.bench', 'specsplit.remote', 'specsplit.cli',"
        " 'grpc', 'google.protobuf', 'matplotlib')))\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
