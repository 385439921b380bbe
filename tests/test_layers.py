"""One direction through the package: the layer contract of pyproject.toml holds, and an import
inside a function is a deliberate, explained exception (an optional heavy dependency), never a
way around an import cycle."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "titan_hydra"


def test_lint_imports_keeps_the_layer_contract(tmp_path):
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    proc = subprocess.run([exe, "--no-logo", "--cache-dir", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``titan_hydra`` import inside a function of ``path``."""
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [(node.lineno, n) for n in names if n.startswith("titan_hydra")]
    return found


def test_imports_inside_functions_say_why():
    """The package's own modules are imported at module level; the few that are not (they pull an
    optional extra such as lm-eval) carry a comment on the import line saying so."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for lineno, module in function_level_imports(path):
            if "#" not in lines[lineno - 1]:
                unexplained.append(f"{path.relative_to(REPO)}:{lineno} imports {module} inside a function")
    assert not unexplained, "\n".join(unexplained)
