"""Loading a script of scripts/ as a module in a test (its sibling modules, measure_args and the like, importable)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/<name>.py as a fresh module; scripts/ is on sys.path for this test only."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
