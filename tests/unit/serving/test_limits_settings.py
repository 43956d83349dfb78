"""Limits a deployment sets: the API token's length and TLS, finite float settings (no services)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specd.core.errors import InvalidArgument
from specd.serving.config import CoordinatorConfig
from specd.serving.security import MIN_TOKEN_CHARS, read_token

TOKEN = "a-token-of-enough-characters"


def test_a_short_token_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("x" * (MIN_TOKEN_CHARS - 1) + "\n")
    with pytest.raises(InvalidArgument, match="at least"):
        read_token(str(path))
    path.write_text("x" * MIN_TOKEN_CHARS)
    assert read_token(str(path)) == "x" * MIN_TOKEN_CHARS


@pytest.mark.parametrize("host, ok", [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False)])
def test_a_token_needs_tls_off_loopback(tmp_path: Path, host: str, ok: bool) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    config = CoordinatorConfig(host=host, api_token_file=str(path))
    if ok:
        config.validate()
    else:
        with pytest.raises(InvalidArgument, match="TLS"):
            config.validate()
        CoordinatorConfig(host=host, api_token_file=str(path), allow_plaintext_token=True).validate()


def test_float_settings_must_be_finite() -> None:
    with pytest.raises(InvalidArgument, match="finite"):
        CoordinatorConfig(draft_retry_s=float("nan")).validate()
    with pytest.raises(InvalidArgument, match="finite"):
        CoordinatorConfig(grace_s=float("inf")).validate()
