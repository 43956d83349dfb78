"""`specd generate` failures read as one line with a distinct exit code; `--verbose` adds the traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specd.tools import cli
from specd.tools.client_errors import EXIT_AUTH, EXIT_DEADLINE, EXIT_TLS, EXIT_UNREACHABLE
from tests.certs import Pki, make_pki
from tests.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
TOKEN = "cli-errors-token"


def dead_address() -> str:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def generate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Run `specd generate ARGS` in-process: (exit code, stderr)."""
    code = cli.main(["generate", "--max-new-tokens", "4", *args, "hello"])
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("specd: "), err
    return lines[0]


def test_dead_address_is_one_line_from_the_real_command() -> None:
    """The command as a user runs it: a new process, nothing listening at the address."""
    address = dead_address()
    run = subprocess.run(
        [sys.executable, "-m", "specd.tools.entry", "generate", "--address", address, "hello"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == EXIT_UNREACHABLE, run.stderr
    line = one_line(run.stderr)
    assert f"cannot reach the coordinator at {address}" in line
    assert run.stdout == ""


def test_verbose_adds_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = generate(capsys, "--address", dead_address(), "--verbose")
    assert code == EXIT_UNREACHABLE
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("specd: cannot reach")


def test_deadline_is_one_line(tiny_cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        ["generate", "--address", tiny_cluster.address, "--timeout", "0.01", "--max-new-tokens", "400"]
        + ["--ignore-eos", "--temperature", "0", "hello"]
    )
    line = one_line(capsys.readouterr().err)
    assert code == EXIT_DEADLINE and "within --timeout 0.01 s" in line


def test_tls_client_to_plaintext_coordinator(
    tiny_cluster: Cluster, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = generate(capsys, "--address", tiny_cluster.address, "--tls-ca", str(pki.ca))
    line = one_line(err)
    assert code == EXIT_TLS and "TLS" in line


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure(tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, pki: Pki, tmp_path_factory: pytest.TempPathFactory):
    """A coordinator with TLS and an API token, over the session's target (no draft)."""
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    coordinator = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    coordinator += ["--api-token-file", str(token_file)]
    with Cluster(
        tiny_pair[0],
        None,
        cache_dir=tmp_path_factory.mktemp("cache"),
        coordinator_args=coordinator,
        borrow_target=tiny_cluster,
    ) as cluster:
        yield cluster, token_file


def test_plaintext_client_to_tls_coordinator(secure, capsys: pytest.CaptureFixture[str]) -> None:
    cluster, token_file = secure
    code, err = generate(capsys, "--address", cluster.address, "--token-file", str(token_file))
    line = one_line(err)
    assert code == EXIT_TLS and "--tls-ca" in line


def test_wrong_ca_is_a_tls_mismatch(secure, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    cluster, token_file = secure
    code, err = generate(
        capsys, "--address", cluster.address, "--tls-ca", str(pki.other_ca), "--token-file", str(token_file)
    )
    one_line(err)
    assert code == EXIT_TLS


def test_wrong_token_is_refused(secure, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster, _ = secure
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-right-api-token\n")  # long enough to be sent (MIN_TOKEN_CHARS)
    code, err = generate(capsys, "--address", cluster.address, "--tls-ca", str(pki.ca), "--token-file", str(wrong))
    line = one_line(err)
    assert code == EXIT_AUTH and "--token-file" in line


def test_right_ca_and_token_work(secure, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    """The same calls succeed with the right settings: the failures above are about them alone."""
    cluster, token_file = secure
    code = cli.main(
        ["generate", "--address", cluster.address, "--tls-ca", str(pki.ca), "--token-file", str(token_file)]
        + ["--max-new-tokens", "4", "--ignore-eos", "--temperature", "0", "--json", "hello"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert len(json.loads(captured.out)["token_ids"]) == 4
