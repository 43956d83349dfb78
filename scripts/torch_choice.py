#!/usr/bin/env python3
"""Which torch build scripts/setup.sh installs, and why: the decision, stdlib only.

    python3 scripts/torch_choice.py --python .venv/bin/python --version 2.13.0

prints two lines: the one-line reason setup shows ("setup: torch: ..."), then the
pip arguments to install it (empty: install nothing). The order of the checks:

1. a torch already importable by --python is kept (a CUDA build put there on purpose);
2. a GPU (nvidia-smi on PATH, or /dev/nvidia0...) gets the configured index's default
   build (PyPI's Linux wheel is a CUDA build);
3. no GPU: PyTorch's CPU index when it answers within --timeout seconds;
4. else the build the configured index would give (pip's dry run asks it): a local
   wheel folder's +cpu wheel if there is one, else its default, which on Linux is
   PyPI's CUDA build (the line says so, with the way to get the CPU build instead).

SPECD_GPU=yes|no overrides step 2's detection; --cpu-index (SPECD_TORCH_CPU_INDEX in
setup.sh) changes the CPU index, e.g. to check step 4 against an address that does not answer.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class Choice:
    line: str  # what setup prints
    pip_args: list[str]  # after `pip install`; empty: nothing to install


def gpu_present(override: str) -> tuple[bool, str]:
    """(is there an NVIDIA GPU, how we know); override 'yes'/'no' wins over detection."""
    if override in ("yes", "no"):
        return override == "yes", f"SPECD_GPU={override}"
    if shutil.which("nvidia-smi"):
        return True, "nvidia-smi is on PATH"
    devices = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if devices:
        return True, f"{devices[0]} exists"
    return False, "no nvidia-smi on PATH and no /dev/nvidia*"


def installed_torch(python: str) -> str | None:
    """'2.13.0+cpu (CPU build)' for the torch `python` imports, or None when it has none."""
    code = "import torch; print(torch.__version__, torch.version.cuda or '')"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    version, _, cuda = out.stdout.strip().partition(" ")
    return f"{version} ({f'CUDA {cuda} build' if cuda else 'CPU build'})"


def reachable(url: str, timeout: float) -> tuple[bool, str]:
    """(does `url` answer within `timeout` seconds, what happened).

    The request runs in a daemon thread joined with the timeout: urlopen's own timeout
    covers the socket, not the name lookup, which can hang for much longer.
    """
    result: list[tuple[bool, str]] = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(url, timeout=timeout + 1) as response:  # the join below ends it first
                result.append((response.status < 400, f"HTTP {response.status}"))
        except urllib.error.HTTPError as e:  # an answer, but not an index (a proxy's error page, say)
            result.append((False, f"HTTP {e.code} {e.reason}"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            result.append((False, f"{type(reason).__name__}: {reason}"[:160]))

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else (False, f"no answer in {timeout:g} s")


def configured_torch(python: str, version: str, timeout: float) -> tuple[str, bool] | str:
    """(the torch version the configured index would install, whether it is a CUDA build), or why not.

    A pip dry run with a report: it reads the wheel's metadata (PyPI serves it apart from the
    wheel), not the wheel. A CUDA build requires nvidia-* / cuda-* packages.
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet"]
        cmd += ["--disable-pip-version-check", "--timeout", str(int(timeout)), "--report", report]
        try:
            done = subprocess.run([*cmd, f"torch=={version}"], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{type(e).__name__}: {e}"[:200]
        if done.returncode != 0 or not os.path.exists(report):
            errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
            return (errors[-1] if errors else f"pip exited {done.returncode}")[:200]
        with open(report) as f:
            items = json.load(f).get("install", [])
    for item in items:
        meta = item.get("metadata", {})
        if meta.get("name", "").lower() == "torch":
            requires = meta.get("requires_dist") or []
            cuda = any(r.lower().startswith(("nvidia-", "cuda-")) for r in requires)
            return str(meta.get("version", version)), cuda or "+cu" in str(meta.get("version", ""))
    return "pip's report names no torch"


def decide(python: str, version: str, cpu_index: str, gpu_override: str, timeout: float, fresh: bool) -> Choice:
    """The build to install; `fresh`: the venv does not exist yet (python is the one that will make it)."""
    have = None if fresh else installed_torch(python)
    if have:
        return Choice(f"setup: torch: keeping the installed torch {have}; setup never replaces an installed torch", [])
    gpu, why_gpu = gpu_present(gpu_override)
    if gpu:
        return Choice(
            f"setup: torch: GPU found ({why_gpu}): installing torch=={version} from the configured index "
            "(PyPI's Linux wheel is a CUDA build)",
            [f"torch=={version}"],
        )
    ok, why = reachable(f"{cpu_index.rstrip('/')}/torch/", timeout)
    if ok:
        return Choice(
            f"setup: torch: no GPU ({why_gpu}): installing the CPU build torch=={version} from PyTorch's CPU index {cpu_index}",
            ["--index-url", cpu_index, f"torch=={version}"],
        )
    unreachable = f"PyTorch's CPU index {cpu_index} is unreachable ({why}; {timeout:g} s limit)"
    found = configured_torch(python, version, timeout)
    if isinstance(found, str):
        return Choice(
            f"setup: torch: no GPU ({why_gpu}); {unreachable}; the configured index could not be asked either "
            f"({found}): trying torch=={version} from it",
            [f"torch=={version}"],
        )
    got, cuda = found
    if not cuda:
        return Choice(
            f"setup: torch: no GPU ({why_gpu}); {unreachable}: installing torch=={got}, the CPU build "
            "the configured index has",
            [f"torch=={got}"],
        )
    return Choice(
        f"setup: torch: no GPU ({why_gpu}); {unreachable}, and the configured index has only the CUDA build: "
        f"installing torch=={got} (several GB; it runs on CPU). For the CPU build, let {cpu_index} be reached "
        f"or put a torch-{version}+cpu wheel in pip's find-links, remove .venv and run setup again",
        [f"torch=={got}"],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the interpreter torch is for (its pip asks the index)")
    ap.add_argument("--version", required=True, help="torch version to install")
    ap.add_argument("--cpu-index", default=CPU_INDEX)
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds the CPU index has to answer")
    ap.add_argument("--fresh", action="store_true", help="no venv yet: do not look for an installed torch")
    args = ap.parse_args()
    gpu_override = os.environ.get("SPECD_GPU", "auto")
    choice = decide(args.python, args.version, args.cpu_index, gpu_override, args.timeout, args.fresh)
    print(choice.line)
    print(" ".join(choice.pip_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
