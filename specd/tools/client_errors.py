"""What a failed call to the coordinator means, in one line, with an exit code per cause.

`specd generate` prints the line instead of a traceback (`--verbose` adds
the traceback). The exit codes are part of the CLI's contract (README,
"Troubleshooting"):

    0 ok · 1 other error · 2 bad usage or argument · 3 coordinator unreachable
    4 TLS mismatch · 5 API token refused · 6 deadline exceeded · 130 interrupted
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import grpc

__all__ = ["EXIT_AUTH", "EXIT_DEADLINE", "EXIT_OTHER", "EXIT_TLS", "EXIT_UNREACHABLE", "CallContext", "explain"]

EXIT_OTHER = 1
EXIT_UNREACHABLE = 3
EXIT_TLS = 4
EXIT_AUTH = 5
EXIT_DEADLINE = 6

# Words in gRPC's UNAVAILABLE details that point at the TLS handshake.
_TLS_WORDS = ("ssl", "tls", "handshake", "certificate", "wrong version number")


@dataclass(frozen=True)
class CallContext:
    """What the caller asked for: where, with TLS or not, with a token or not, and its timeout."""

    address: str
    tls: bool
    token: bool
    timeout_s: float | None


def _accepts_connections(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at HOST:PORT (a server that is up, whatever it speaks)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def explain(exc: grpc.RpcError, ctx: CallContext) -> tuple[int, str]:
    """(exit code, one line) for a failed call; the line says what to check or change."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    where = f"the coordinator at {ctx.address}"
    if code == grpc.StatusCode.UNAVAILABLE:
        lowered = details.lower()
        if any(word in lowered for word in _TLS_WORDS):
            if ctx.tls:
                return EXIT_TLS, (
                    f"TLS handshake with {where} failed: it serves plaintext, or its certificate is not signed "
                    "by the CA in --tls-ca (or not issued for this address)"
                )
            return EXIT_TLS, f"{where} expects TLS: pass its CA bundle with --tls-ca"
        if _accepts_connections(ctx.address):
            if ctx.tls:
                return EXIT_TLS, (
                    f"{where} accepts connections but the TLS handshake failed: it may serve plaintext "
                    "(drop --tls-ca), or its certificate is not signed by the CA in --tls-ca"
                )
            return EXIT_TLS, (
                f"{where} accepts connections but not plaintext gRPC: it may expect TLS (pass --tls-ca CA.pem)"
            )
        return EXIT_UNREACHABLE, (
            f"cannot reach {where}: nothing accepts connections there. Is it running (`specd up`), "
            "and is --address right?"
        )
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        given = "the token in --token-file" if ctx.token else "no API token"
        return EXIT_AUTH, (
            f"{where} refused the call ({details or code.name}): it was sent {given}; pass the coordinator's "
            "token with --token-file"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        limit = f"--timeout {ctx.timeout_s:g} s" if ctx.timeout_s else "the deadline"
        return EXIT_DEADLINE, (
            f"no complete answer from {where} within {limit}: raise --timeout, or ask for fewer tokens"
        )
    name = code.name if code is not None else "an error"
    return EXIT_OTHER, f"{where} answered {name}: {details}"
