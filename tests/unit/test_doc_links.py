"""The README and the docs pages link only to files that exist, and the README links every page.

Checks every relative markdown link, ``[text](target)`` and ``![alt](target)``, in
``README.md`` and ``docs/**/*.md``: the target, without its ``#anchor``, must exist relative
to the file that holds the link. Web and mail links and pure ``#anchor`` links are not
checked, nor is anything inside code (fenced blocks and inline code spans). Every top-level
docs page (``docs/*.md``) must be linked from the README, so a newcomer can reach it.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote


def _repo_root() -> Path:
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise RuntimeError(f"no folder above {__file__} holds pyproject.toml")


ROOT = _repo_root()

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+).*?\1")
# [text](target) or ![alt](target); the text may hold nested brackets one level deep.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(][^)]*)?\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _markdown_files() -> list[Path]:
    files = [ROOT / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)[0] * len(opening.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        yield number, _INLINE_CODE.sub("", line)


def _relative_links(path: Path):
    """(line number, raw target, target path without anchor) of every relative link in path."""
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(line):
            target = match.group(1).strip("<>").strip()
            if not target or target.startswith("#") or _SCHEME.match(target):
                continue
            file_part = unquote(target.split("#", 1)[0].split("?", 1)[0])
            if file_part:
                yield number, target, file_part


def _where(path: Path) -> str:
    """path relative to the repository root where it lies under it, else as it is."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def test_markdown_files_are_found():
    files = _markdown_files()
    assert ROOT / "README.md" in files, f"no README.md at the repository root {ROOT}"
    assert any(f.parent == ROOT / "docs" for f in files), f"no docs/*.md page under {ROOT}"


def test_every_relative_link_resolves():
    broken = []
    for path in _markdown_files():
        for number, target, file_part in _relative_links(path):
            resolved = (path.parent / file_part).resolve()
            if not resolved.exists():
                broken.append(f"  {_where(path)}:{number}: ({target}) -> {_where(resolved)} does not exist")
    assert not broken, f"{len(broken)} broken relative link(s) in the docs:\n" + "\n".join(broken)


def test_readme_links_every_docs_page():
    readme = ROOT / "README.md"
    linked = {(readme.parent / file_part).resolve() for _, _, file_part in _relative_links(readme)}
    pages = sorted((ROOT / "docs").glob("*.md"))
    missing = [_where(page) for page in pages if page.resolve() not in linked]
    assert not missing, (
        "README.md does not link these docs pages (add them to its list of "
        "pages to read on):\n" + "\n".join(f"  {page}" for page in missing)
    )
