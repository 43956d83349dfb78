"""scripts/uv_sources.py: uv is given the sources pip is configured with, the environment winning.

Real pip (the tests' interpreter) reading a pip.conf written here and PIP_* variables; nothing is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from scripts.uv_sources import pip_config, uv_arguments


@pytest.fixture
def pip_conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A pip.conf of its own, and none of the machine's (PIP_CONFIG_FILE=os.devnull turns every file off)."""
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\n"
        "index-url = https://mirror.example/simple\n"
        "extra-index-url = file:///a/simple file:///b/simple\n"
        "find-links = /from/file\n"
        "constraint = /etc/constraints.txt\n"
        "cert = /etc/ca.pem\n"
    )
    for name in (
        "PIP_FIND_LINKS",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "PIP_CONSTRAINT",
        "PIP_CERT",
        "PIP_NO_INDEX",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    return conf


def test_a_pip_conf_becomes_uv_arguments(pip_conf: Path) -> None:
    config = pip_config(sys.executable)
    assert config["cert"] == "/etc/ca.pem"
    args = uv_arguments(config)
    assert args == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///a/simple",
        "--extra-index-url", "file:///b/simple",
        "--find-links", "/from/file",
        "--constraint", "/etc/constraints.txt",
        "--index-strategy", "unsafe-best-match",
        "--compile-bytecode",
    ]  # fmt: skip


def test_the_environment_wins_over_the_file(pip_conf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", "/from/env")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    args = uv_arguments(pip_config(sys.executable))
    assert args[args.index("--find-links") + 1] == "/from/env"
    assert args.count("--find-links") == 1
    assert "--no-index" in args


def test_no_configuration_leaves_uv_its_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "PIP_FIND_LINKS",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "PIP_CONSTRAINT",
        "PIP_CERT",
        "PIP_NO_INDEX",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    assert uv_arguments(pip_config(sys.executable)) == ["--index-strategy", "unsafe-best-match", "--compile-bytecode"]
