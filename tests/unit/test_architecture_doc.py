"""docs/architecture.md names every module of the package, and its `## Every module` section
names none that is gone: a module added, moved or removed without the map following fails
here, listing what is missing or stale."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llmrun"
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Every module"

# A path-like name as a whole word: `chat/formats/xml.py`, `bounds.py`, `engine/llama/`.
MODULE_NAME = re.compile(r"(?<![\w/.-])((?:\w+/)*\w+\.py)(?![\w/])")
PACKAGE_NAME = re.compile(r"`((?:\w+/)+)`")


def modules() -> set[str]:
    """Every module under llmrun/ as its path relative to llmrun/ (no __init__.py)."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            if p.name != "__init__.py"}


def packages() -> set[str]:
    """Every package under llmrun/ as `pkg/` (the root left out)."""
    return {p.parent.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.rglob("__init__.py")
            if p.parent != PACKAGE}


def section(text: str) -> str:
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def exists(name: str) -> bool:
    """A name is the package's (`server/fit.py`), or the repository's where it starts with
    one of the repository's own folders (`llmrun/ui/`, `modelfiles/`, `tests/...`)."""
    first = name.split("/", 1)[0]
    if "/" in name and (ROOT / first).is_dir() and not (PACKAGE / first).exists():
        return (ROOT / name).exists()
    return (PACKAGE / name).exists()


def test_every_module_and_package_is_named() -> None:
    text = DOC.read_text(encoding="utf-8")
    named = set(MODULE_NAME.findall(text))
    missing = sorted(modules() - named)
    missing += sorted(p for p in packages() if f"`{p}`" not in text)
    assert not missing, (f"docs/architecture.md does not name {len(missing)} module(s) or "
                         f"package(s) (add each to {SECTION!r}, with its one job): "
                         + ", ".join(missing))


def test_every_name_in_the_section_exists() -> None:
    part = section(DOC.read_text(encoding="utf-8"))
    names = set(MODULE_NAME.findall(part)) | set(PACKAGE_NAME.findall(part))
    stale = sorted(n for n in names if not exists(n))
    assert not stale, (f"{SECTION!r} in docs/architecture.md names what llmrun/ lacks: "
                       + ", ".join(stale))


def test_the_checks_read_names_whole() -> None:
    found = MODULE_NAME.findall("`bench/__main__.py`, a/b.py; llmrun/x.py, not.a.py.txt")
    assert found == ["bench/__main__.py", "a/b.py", "llmrun/x.py"]
    assert "__main__.py" not in found
