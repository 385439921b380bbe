"""The fast tier (``pytest -m "not slow"``) and CI's gate (``-m "not extended"``, docs/testing.md)
still run every test module.

A module whose every test is marked ``slow`` (or ``extended``) would vanish from the tier without
anyone noticing: read the marks from the source (no import, no collection) and require one unmarked
test per module. (A ``@pytest.mark.gate(...)`` test keeps the parametrizations it names.)
"""

from __future__ import annotations

import ast

import pytest
from helpers import REPO


def _is_marked(node: ast.expr, mark: str) -> bool:
    """``pytest.mark.<mark>`` (a decorator, or one of a ``pytestmark`` list)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_marked(e, mark) for e in node.elts)
    return ast.unparse(node) == f"pytest.mark.{mark}"


def unmarked_tests(source: str, mark: str = "slow") -> list[str]:
    """The tests of a module that ``-m "not <mark>"`` keeps."""
    tree = ast.parse(source)
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
           and _is_marked(n.value, mark) for n in tree.body):
        return []
    kept = []
    for node in tree.body:
        scopes = [(node, [])] if not isinstance(node, ast.ClassDef) else [
            (child, node.decorator_list) for child in node.body]
        for fn, outer in scopes:
            if (isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("test")
                    and not any(_is_marked(d, mark) for d in [*outer, *fn.decorator_list])):
                kept.append(fn.name)
    return kept


@pytest.mark.parametrize("mark", ["slow", "extended"])
def test_every_module_keeps_a_test_outside_slow_and_extended(mark):
    modules = sorted((REPO / "tests").glob("test_*.py"))
    assert len(modules) > 50
    empty = [m.name for m in modules if not unmarked_tests(m.read_text(), mark)]
    assert not empty, f"only {mark} tests in {empty}: the tier without them would skip these modules"


def test_the_reader_sees_marks_on_functions_classes_and_modules():
    marked = "import pytest\n@pytest.mark.slow\ndef test_a():\n    pass\n"
    assert unmarked_tests(marked) == []
    assert unmarked_tests(marked + "def test_b():\n    pass\n") == ["test_b"]
    assert unmarked_tests("import pytest\n@pytest.mark.slow\nclass TestX:\n    def test_c(self):\n        pass\n") == []
    assert unmarked_tests("import pytest\npytestmark = pytest.mark.slow\ndef test_d():\n    pass\n") == []
