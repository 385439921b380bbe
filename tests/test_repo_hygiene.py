"""The repository stands alone: no file sends a reader to documents that are not in it."""

from __future__ import annotations

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
