"""keep_freed_buffers' setting: off at 0, bounded (tests/slow/test_malloc_keep.py checks its effect)."""

from __future__ import annotations

import pytest

from specd.core.errors import InvalidArgument
from specd.serving.config import DraftConfig
from specd.serving.host_memory import keep_freed_buffers


def test_zero_leaves_the_defaults() -> None:
    assert keep_freed_buffers(0) is False


def test_the_setting_is_bounded() -> None:
    assert DraftConfig().malloc_keep_mib == 32
    with pytest.raises(InvalidArgument, match="--malloc-keep-mib"):
        DraftConfig(malloc_keep_mib=-1).validate()
    with pytest.raises(InvalidArgument, match="--malloc-keep-mib"):
        DraftConfig(malloc_keep_mib=4096).validate()
