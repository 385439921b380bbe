"""The repository stands alone: no file sends a reader to documents that are not in it; and no
function is too long to read in one screen."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Names of design/notes files that live outside this repository.
FOREIGN = re.compile(r"FACTS\.md|DESIGN\.md|REFERENCES\.md|\.\./shared/")


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".in", ""}
    return [ROOT / f for f in out.splitlines() if Path(f).suffix in suffixes and (ROOT / f).is_file()]


def test_no_reference_to_files_outside_the_repository():
    files = tracked_text_files()
    assert len(files) > 50  # the listing worked
    hits = []
    for path in files:
        if path.name == Path(__file__).name:
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if FOREIGN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


MAX_FUNCTION_LINES = 60


def long_functions(path: Path) -> dict[str, int]:
    """{qualified name: lines from ``def`` to the last line} of the functions over the limit."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                length = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and length > MAX_FUNCTION_LINES:
                    found[name] = length
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def test_no_function_is_longer_than_60_lines():
    files = sorted([*(ROOT / "titan_hydra").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")])
    assert len(files) > 50  # the walk found the package
    too_long = [f"{path.relative_to(ROOT).as_posix()}: {name} is {length} lines"
                for path in files for name, length in long_functions(path).items()]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(too_long)


def test_the_length_check_sees_methods_and_nested_functions(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # 60 lines
    src = f"class A:\n    def short(self):\n        pass\n    def long(self):\n{body}\n\n" \
          f"def outer():\n    def inner():\n{body}\n"
    (tmp_path / "m.py").write_text(src)
    assert long_functions(tmp_path / "m.py") == {"A.long": 61, "outer": 62, "outer.inner": 61}


def test_recipes_are_command_lines_over_the_package():
    """No recipe edits sys.path or imports another recipe: shared code lives in the package."""
    recipes = {p.stem for p in (ROOT / "recipes").glob("*.py")}
    problems = []
    for path in sorted((ROOT / "recipes").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                problems.append(f"{path.name}:{node.lineno} sys.path")
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            problems += [f"{path.name}:{node.lineno} imports {n}" for n in names
                         if n.split(".")[0] in recipes | {"recipes"}]
    assert not problems, problems
