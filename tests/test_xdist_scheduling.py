"""The suite's own scheduler (xdist_scheduling.py) survives a worker that dies mid-module.

A real pytest-xdist session in a subprocess, over a throwaway test tree whose middle module kills
its worker: the session must end (xdist 3.8's own scope scheduler hangs here; a CI run once sat
at its 90-minute limit), report the crash as one failure, run the crashed test once and every
other test exactly once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
from xdist_scheduling import ModuleScheduling

def pytest_xdist_make_scheduler(config, log):
    return ModuleScheduling(config, log)
"""

# Each test appends its name to a log, so the runs of every test can be counted afterwards.
MODULE = """
import os

def mark(name):
    with open(os.environ["RUN_LOG"], "a") as f:
        f.write(name + "\\n")
"""


def module(*tests: str) -> str:
    return MODULE + "".join(textwrap.dedent(t) for t in tests)


def test_a_dead_worker_ends_in_one_failure_not_a_hang(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "conftest.py").write_text(CONFTEST)
    (tree / "test_a.py").write_text(module(*(f"\ndef test_a{i}():\n    mark('a{i}')\n" for i in range(3))))
    (tree / "test_b.py").write_text(module(
        "\ndef test_b0():\n    mark('b0')\n",
        "\ndef test_crash():\n    mark('crash')\n    os._exit(1)\n",
        "\ndef test_after():\n    mark('after')\n",
    ))
    (tree / "test_c.py").write_text(module("\ndef test_c0():\n    mark('c0')\n"))
    log = tmp_path / "runs.log"
    env = {"RUN_LOG": str(log), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-p", "no:randomly", str(tree)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 6 passed" in out, out
    assert "crashed while running 'test_b.py::test_crash'" in out, out
    runs = log.read_text().split()
    assert sorted(runs) == sorted(["a0", "a1", "a2", "b0", "crash", "after", "c0"]), (runs, out)
