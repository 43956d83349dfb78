"""Certificates, keys and the API token, re-read when their files change (no restart).

cert-manager renews certificates before they expire and updates the mounted
Secret in place (an atomic symlink swap); a rotated token Secret arrives the
same way. Each piece here watches its files (mtime, size and inode, looked at
no more than once a second) and picks up a complete new set on its next use:

- servers: gRPC's dynamic server credentials ask `ReloadingServerCredentials`
  before each new TLS handshake; connections already open keep their session;
- the coordinator's channels to its peers: `ReloadingChannel` opens a new
  channel with the new client certificate for every call made after a change
  (a long-lived round stream moves over when it next reconnects);
- the token: `TokenFile` accepts the new token at once and the previous one
  for a grace period, so clients can switch without a failed request.

A file caught half-written (unreadable, or a key that does not match) is
logged and the previous material stays in use until the next change.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0  # the files are looked at no more often than this


class FileWatch:
    """Tells whether any of some files changed since the last time it said so."""

    def __init__(self, paths: Sequence[str], *, interval_s: float = CHECK_INTERVAL_S) -> None:
        self.paths = [p for p in paths if p]
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._seen = self._stamp()
        self._checked = time.monotonic()

    def _stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        out: list[tuple[int, int, int] | None] = []
        for p in self.paths:
            try:
                st = os.stat(p)  # follows symlinks: a Secret volume's ..data swap changes the inode
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def changed(self, *, now_please: bool = False) -> bool:
        """True once per change (throttled to one look per interval_s, unless now_please)."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked < self.interval_s and not now_please:
                return False
            self._checked = now
            stamp = self._stamp()
            if stamp == self._seen:
                return False
            self._seen = stamp
            return True

    def accept(self) -> None:
        """Take the files as they are now as seen (after reading them)."""
        with self._lock:
            self._seen = self._stamp()


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def read_key_pair(cert: str, key: str) -> tuple[bytes, bytes]:
    """(certificate chain, private key) bytes, checked to belong together.

    A rotation that replaces the two files one after the other can be caught
    between them; gRPC would take the mismatched pair and fail every handshake.
    """
    cert_bytes, key_bytes = _read(cert), _read(key)
    with tempfile.TemporaryDirectory() as tmp:
        c, k = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        c.write_bytes(cert_bytes)
        k.write_bytes(key_bytes)
        ssl.create_default_context().load_cert_chain(c, k)  # ssl.SSLError if they do not match
    return cert_bytes, key_bytes


class ReloadingServerCredentials:
    """TLS (or mutual TLS) server credentials whose certificate, key and client CA follow their files."""

    def __init__(self, cert: str, key: str, client_ca: str = "") -> None:
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self.watch = FileWatch([cert, key, client_ca])
        self.reloads = 0  # how many times new material was taken (for tests and logs)

    def _configuration(self) -> Any:
        cert, key = read_key_pair(self.cert, self.key)
        return grpc.ssl_server_certificate_configuration(
            [(key, cert)],
            root_certificates=_read(self.client_ca) if self.client_ca else None,
        )

    def _fetch(self) -> Any:
        """Called by gRPC before each new handshake: a new configuration, or None for no change."""
        if not self.watch.changed():
            return None
        try:
            config = self._configuration()
        except Exception as exc:  # noqa: BLE001 - mid-rotation: keep the current material
            log.warning("TLS files changed but could not be read (%s); keeping the current certificate", exc)
            return None
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.cert)
        return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), self._fetch, require_client_authentication=bool(self.client_ca)
        )


class ReloadingChannel:
    """A grpc.aio channel stand-in whose calls go to a channel made with the current files.

    `make()` opens a channel reading the certificate files as they are now. When
    they change, the next call opens a new channel; calls already running finish
    on theirs. Stubs work unchanged: they ask for multicallables once, and each of
    those picks the current channel on every call. The channel before the current
    one stays open (a long stream may still run on it); older ones are closed.
    """

    def __init__(self, make: Callable[[], grpc.aio.Channel], paths: Sequence[str]) -> None:
        self._make = make
        self.watch = FileWatch(paths)
        self._channels: list[grpc.aio.Channel] = [make()]
        self.reloads = 0
        self._retired: list[grpc.aio.Channel] = []

    def current(self) -> grpc.aio.Channel:
        if self.watch.changed():
            try:
                fresh = self._make()
            except Exception as exc:  # noqa: BLE001 - mid-rotation: keep the current channel
                log.warning("peer TLS files changed but could not be read (%s); keeping the current channel", exc)
            else:
                self._channels.append(fresh)
                self._retired.extend(self._channels[:-2])
                del self._channels[:-2]
                self.reloads += 1
                log.info("peer TLS certificate reloaded: new connections use it")
        return self._channels[-1]

    def _multicallable(self, kind: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        owner = self

        class _Current:
            def __call__(self, *call_args: Any, **call_kwargs: Any) -> Any:
                channel = owner.current()
                return getattr(channel, kind)(method, *args, **kwargs)(*call_args, **call_kwargs)

        return _Current()

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._multicallable("unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._multicallable("unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._multicallable("stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._multicallable("stream_stream", method, args, kwargs)

    async def close(self, grace: float | None = None) -> None:
        for channel in [*self._retired, *self._channels]:
            await channel.close(grace)
        self._retired.clear()


class TokenFile:
    """The API token, re-read when its file changes; the previous one stays valid for grace_s."""

    def __init__(self, path: str, read: Callable[[str], str], *, grace_s: float = 300.0) -> None:
        self.path = path
        self._read = read
        self.grace_s = grace_s
        self.watch = FileWatch([path])
        self.current = read(path)
        self._previous: str | None = None
        self._previous_until = 0.0

    def valid(self, *, recheck: bool = False) -> list[str]:
        """The tokens a caller may send now (current first).

        recheck: look at the file now, not at most once a second. The interceptor asks for
        it before refusing a token, so a client that switched to a just-rotated token is not
        refused in the second before the throttled look would have seen the new file (a
        stat per refused call: cheap, and nothing is read unless the file changed)."""
        if self.watch.changed(now_please=recheck):
            try:
                token = self._read(self.path)
            except Exception as exc:  # noqa: BLE001 - mid-rotation or a bad token: keep the current one
                log.warning("API token file changed but was refused (%s); keeping the current token", exc)
            else:
                if token != self.current:
                    self._previous, self._previous_until = self.current, time.monotonic() + self.grace_s
                    self.current = token
                    log.info("API token reloaded; the previous one stays valid for %.0f s", self.grace_s)
        if self._previous is not None and time.monotonic() < self._previous_until:
            return [self.current, self._previous]
        self._previous = None
        return [self.current]
