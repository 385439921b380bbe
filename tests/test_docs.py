"""The README and docs/ agree with the repository: option tables match conf/, links resolve.

Pure file parsing: nothing from titan_hydra is imported, nothing is composed or run.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONF = ROOT / "conf"
MODELS = ROOT / "titan_hydra" / "models"
MAX_README_LINES = 350

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
BACKTICKED = re.compile(r"`([^`\n]+)`")


def readme() -> str:
    return README.read_text(encoding="utf-8")


def section(text: str, title_prefix: str) -> str:
    """The body of the first ``## `` section whose title starts with ``title_prefix``."""
    match = re.search(rf"^## {re.escape(title_prefix)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no section '## {title_prefix}...'"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """Cells of every markdown table row in ``text`` (header and separator rows included)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|"):
            rows.append([cell.strip() for cell in line[1:-1].split("|")])
    return rows


def config_groups() -> list[Path]:
    return sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")


def yaml_stems(group: Path) -> set[str]:
    return {p.stem for p in group.glob("*.yaml")}


def test_config_tree_table_lists_exactly_the_options_in_conf():
    rows = {}
    for cells in table_rows(section(readme(), "Config tree")):
        first = re.fullmatch(r"`([^`]+)`", cells[0])
        if first and len(cells) >= 2:
            rows[first.group(1)] = {opt.strip().strip("`") for opt in cells[1].split(",") if opt.strip()}
    groups = config_groups()
    assert groups, "no config groups found under conf/"
    problems = []
    for group in groups:
        if group.name not in rows:
            problems.append(f"group `{group.name}`: no row in the README's config tree table")
            continue
        want, listed = yaml_stems(group), rows[group.name]
        if want - listed:
            problems.append(f"group `{group.name}`: missing {sorted(want - listed)} (in conf/{group.name}/)")
        if listed - want:
            problems.append(f"group `{group.name}`: lists {sorted(listed - want)}, which conf/{group.name}/ does not have")
    extra = set(rows) - {g.name for g in groups}
    if extra:
        problems.append(f"table rows for groups that conf/ does not have: {sorted(extra)}")
    assert not problems, "README config tree table vs conf/:\n" + "\n".join(problems)


def test_families_table_names_every_model_option():
    table = "\n".join("|".join(cells) for cells in table_rows(section(readme(), "Model families")))
    assert table, "README's '## Model families' section has no table"
    named = set(BACKTICKED.findall(table))
    missing = sorted(yaml_stems(CONF / "model") - named)
    assert not missing, f"README's families table does not name these conf/model options in backticks: {missing}"


def test_relative_links_resolve():
    files = [README, *sorted(DOCS.glob("*.md"))]
    broken = []
    for path in files:
        text = INLINE_CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            file_part = target.split("#", 1)[0]
            if not (path.parent / file_part).exists():
                broken.append(f"{path.relative_to(ROOT)}: ({target}) does not exist")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_docs_start_with_a_title_and_are_linked_from_the_readme():
    docs = sorted(DOCS.glob("*.md"))
    assert docs, "docs/ holds no markdown files"
    untitled = [p.name for p in docs if not p.read_text(encoding="utf-8").startswith("# ")]
    assert not untitled, f"docs files that do not start with a '# Title' line: {untitled}"
    linked = {t.split("#", 1)[0] for t in LINK.findall(FENCE.sub("", readme()))}
    unlinked = [f"docs/{p.name}" for p in docs if f"docs/{p.name}" not in linked]
    assert not unlinked, f"docs files the README does not link to: {unlinked}"


def test_readme_is_short():
    lines = len(readme().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, over {MAX_README_LINES}: move detail into docs/ and link it")


def test_code_layout_names_every_model_package():
    layout = section(readme(), "Layout of the code")
    packages = sorted(p.name for p in MODELS.iterdir()
                      if p.is_dir() and p.name not in ("common", "__pycache__"))
    assert packages, "no model packages found under titan_hydra/models/"
    missing = [name for name in packages if not re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", layout)]
    assert not missing, f"README's 'Layout of the code' does not name these titan_hydra/models/ packages: {missing}"


def test_design_module_map_names_every_module():
    """docs/design.md's map names every module of the package (a new module gets its line there):
    each file by its name, inside the block of its top-level package or module."""
    design = (DOCS / "design.md").read_text(encoding="utf-8")
    layout = design[design.index("## Layout of the code"):]
    package = ROOT / "titan_hydra"
    missing = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py" or "__pycache__" in path.parts:
            continue
        top = path.relative_to(package).parts[0]
        block = re.search(rf"^titan_hydra/{re.escape(top)}\b.*?(?=^\S|\Z)", layout, re.M | re.S)
        if block is None or not re.search(rf"(?<![\w.]){re.escape(path.name)}(?!\w)", block.group(0)):
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/design.md's module map does not name: {missing}"
