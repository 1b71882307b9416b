"""Two import directions of docs/architecture.md, read from the source: kernels/ imports nothing else of dspark_sgl
(its torch references live beside the kernels; speculative/ and training import them), and dspark_sgl never imports
training (the CLI and the serving dry run reach it through entry points)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports, function-level imports included; relative imports made absolute."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            found.add(".".join(base + ((node.module,) if node.module else ())))
    return found


def crossings(folder: str, allowed, root: Path = ROOT) -> dict[str, list[str]]:
    """{file: the dspark_sgl/training modules it imports that `allowed(module)` refuses}."""
    out = {}
    for path in sorted((root / folder).rglob("*.py")):
        ours = (m for m in imports(path, root) if m.split(".")[0] in ("dspark_sgl", "training"))
        bad = sorted(m for m in ours if not allowed(m))
        if bad:
            out[str(path.relative_to(root))] = bad
    return out


def test_kernels_import_no_other_layer():
    assert crossings("dspark_sgl/kernels", lambda m: m.startswith("dspark_sgl.kernels")) == {}


def test_dspark_sgl_never_imports_training():
    assert crossings("dspark_sgl", lambda m: m.split(".")[0] != "training") == {}
