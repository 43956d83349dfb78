"""Model folders specd builds are readable by every user; loading errors name the path and the real cause.

A container image bakes its models as root and serves them as a non-root
user, so every file specd writes must be readable by others (0644, folders
0755). `specd prepare` and `specd serve` as processes: tests/services/test_model_files.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specd.core.errors import InvalidArgument
from specd.core.model import catalog
from specd.core.model.loading import load_pretrained
from specd.tools.tiny_models import build_tiny_pair
from tests.permissions import unreadable_by_others


def test_built_folders_are_readable_by_others(tmp_path: Path) -> None:
    target, draft = build_tiny_pair(tmp_path / "tiny")
    cut = catalog._untrained_cut(target, tmp_path / "cut")  # the demo draft's recipe, on the tiny target
    for folder in (target, draft, cut):
        assert (folder / "model.safetensors").is_file()
        assert unreadable_by_others(folder) == []


def test_corrupt_weights_are_named(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_pair[0], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, e.g. a copy that ran out of disk
    with pytest.raises(InvalidArgument, match="corrupt or truncated") as info:
        load_pretrained(folder)
    assert str(weights) in str(info.value)


def test_missing_weights_are_named(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_pair[0], folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(InvalidArgument, match="has no weights"):
        load_pretrained(folder)
