"""Which replicas a peer address names, kept up to date.

A coordinator's --target / --draft is a comma-separated list of entries:

- ``HOST:PORT``: one replica, dialled as written (gRPC resolves the name).
- ``dns:///HOST:PORT`` (or ``dns:HOST:PORT``): every address the name
  resolves to is a replica, re-resolved every few seconds. A Kubernetes
  headless Service resolves to one address per ready pod, so replicas
  appear and leave as pods do.

`Discovery` resolves the names with the event loop's resolver (a thread),
at most one lookup per name in flight and each bounded by a timeout, and
reports the set's changes (added, removed). A name that fails to resolve
keeps its last addresses: a DNS hiccup must not drop every replica (their
streams tell whether they are really gone).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from specd.core.errors import InvalidArgument

log = logging.getLogger(__name__)

DNS_PREFIXES = ("dns:///", "dns:")

Resolve = Callable[[str, int], Awaitable[Sequence[str]]]  # (host, port) -> IP addresses
OnChange = Callable[[frozenset["Replica"], frozenset["Replica"]], None]  # (added, removed)


@dataclass(frozen=True, order=True)
class Replica:
    """One peer process: the address a channel dials and the name it was found under."""

    address: str  # HOST:PORT or IP:PORT ([IPv6]:PORT)
    authority: str = ""  # the DNS name of a resolved replica (TLS name check); empty: the address's host

    @property
    def name(self) -> str:
        """How logs, metrics and spans name the replica."""
        return self.address


@dataclass(frozen=True)
class PeerAddress:
    """A parsed --target / --draft value: fixed addresses and names to resolve."""

    static: tuple[str, ...]
    names: tuple[tuple[str, int], ...]  # (host, port) resolved to all their addresses

    @property
    def dynamic(self) -> bool:
        return bool(self.names)


def split_host_port(text: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); InvalidArgument if malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"peer address {text!r} must be HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_peer_address(text: str) -> PeerAddress:
    """Parse 'a:1,b:2,dns:///svc:3'; InvalidArgument says what is wrong."""
    static: list[str] = []
    names: list[tuple[str, int]] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        prefix = next((p for p in DNS_PREFIXES if entry.startswith(p)), None)
        if prefix is not None:
            names.append(split_host_port(entry[len(prefix) :]))
        else:
            split_host_port(entry)  # validates
            static.append(entry)
    if not static and not names:
        raise InvalidArgument(f"peer address {text!r} names no replica (HOST:PORT, a list, or dns:///HOST:PORT)")
    return PeerAddress(tuple(dict.fromkeys(static)), tuple(dict.fromkeys(names)))


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (A and AAAA), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class Discovery:
    """Keeps the replica set of one PeerAddress and reports its changes to on_change."""

    def __init__(
        self,
        address: PeerAddress,
        on_change: OnChange,
        *,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        resolve: Resolve = resolve_all,
    ) -> None:
        self.address = address
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_change = on_change
        self._resolve = resolve
        self._by_name: dict[tuple[str, int], frozenset[Replica]] = {}
        self._lookups: dict[tuple[str, int], asyncio.Task[Sequence[str]]] = {}
        self.replicas: frozenset[Replica] = frozenset()
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> frozenset[Replica]:
        """Resolve every name once (concurrently), report the changes, return the set."""
        if self.address.names:
            await asyncio.gather(*(self._refresh_name(name) for name in self.address.names))
        found = frozenset(Replica(a) for a in self.address.static).union(*self._by_name.values())
        added, removed = found - self.replicas, self.replicas - found
        self.replicas = found
        if added or removed:
            log.info(
                "replicas of %s: +%s -%s",
                self._describe(),
                sorted(r.name for r in added),
                sorted(r.name for r in removed),
            )
            self._on_change(added, removed)
        return found

    async def _refresh_name(self, name: tuple[str, int]) -> None:
        host, port = name
        lookup = self._lookups.get(name)
        if lookup is None or lookup.done():  # a lookup stuck in the resolver is not doubled
            lookup = asyncio.ensure_future(self._resolve(host, port))
            self._lookups[name] = lookup
        try:
            addresses = await asyncio.wait_for(asyncio.shield(lookup), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - resolution failed or timed out: keep the last addresses
            log.warning(
                "resolving %s failed (%s); keeping its %d known replicas", host, exc, len(self._by_name.get(name, ()))
            )
            return
        if not addresses:
            log.warning(
                "%s resolved to no address; keeping its %d known replicas", host, len(self._by_name.get(name, ()))
            )
            return
        self._by_name[name] = frozenset(Replica(join_host_port(a, port), authority=host) for a in addresses)

    def start(self) -> None:
        """Re-resolve every interval_s in the background (nothing to do for fixed addresses)."""
        if self._task is None and self.address.dynamic:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"discovery-{self._describe()}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # keep discovering
                log.exception("replica discovery of %s failed", self._describe())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for lookup in self._lookups.values():
            lookup.cancel()

    def _describe(self) -> str:
        return ",".join([*self.address.static, *(f"dns:///{join_host_port(h, p)}" for h, p in self.address.names)])
