"""File modes of model folders: what a non-root user of a container image could not read."""

from __future__ import annotations

import stat
from pathlib import Path


def unreadable_by_others(folder: Path) -> list[str]:
    """Files without o+r and folders without o+rx under `folder` (and `folder` itself)."""
    bad = []
    for path in [folder, *folder.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        need = stat.S_IROTH | stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH
        if mode & need != need:
            bad.append(f"{path} {stat.filemode(mode)}")
    return bad
