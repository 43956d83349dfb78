"""Replica discovery: address parsing, static lists, DNS names re-resolved (with a resolver the test controls)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.discovery import Discovery, Replica, parse_peer_address, resolve_all
from specd.core.errors import InvalidArgument


def test_parse_static_lists_and_dns_names() -> None:
    a = parse_peer_address("10.0.0.1:50053, 10.0.0.2:50053,dns:///target-headless.ns.svc:50053,[::1]:7")
    assert a.static == ("10.0.0.1:50053", "10.0.0.2:50053", "[::1]:7")
    assert a.names == (("target-headless.ns.svc", 50053),)
    assert parse_peer_address("dns:svc:1").names == (("svc", 1),)
    assert not parse_peer_address("127.0.0.1:1").dynamic


@pytest.mark.parametrize("bad", ["", " , ", "nohost", "h:", "h:0", "h:99999", "dns:///svc", "h:x"])
def test_parse_rejects_what_names_no_replica(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_peer_address(bad)


def test_static_list_is_reported_once() -> None:
    changes: list[tuple[set[str], set[str]]] = []

    async def main() -> None:
        d = Discovery(
            parse_peer_address("127.0.0.1:1,127.0.0.1:2"),
            lambda add, rem: changes.append(({r.address for r in add}, {r.address for r in rem})),
            interval_s=0.01,
        )
        await d.refresh()
        d.start()  # nothing to re-resolve: no task
        await asyncio.sleep(0.05)
        await d.refresh()
        await d.close()

    asyncio.run(main())
    assert changes == [({"127.0.0.1:1", "127.0.0.1:2"}, set())]


def test_dns_name_is_re_resolved_and_changes_reported() -> None:
    answers = {"svc": ["10.0.0.1", "10.0.0.2"]}
    changes: list[tuple[set[str], set[str]]] = []

    async def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError("Name or service not known")
        return answers[host]

    async def main() -> None:
        d = Discovery(
            parse_peer_address("dns:///svc:9"),
            lambda add, rem: changes.append(({r.address for r in add}, {r.address for r in rem})),
            interval_s=0.02,
            resolve=resolve,
        )
        await d.refresh()
        assert {(r.address, r.authority) for r in d.replicas} == {("10.0.0.1:9", "svc"), ("10.0.0.2:9", "svc")}
        d.start()
        answers["svc"] = ["10.0.0.2", "10.0.0.3"]  # a pod replaced
        await _until(lambda: len(changes) == 2)
        del answers["svc"]  # DNS trouble: the last addresses stay
        await asyncio.sleep(0.1)
        answers["svc"] = ["::1"]
        await _until(lambda: len(changes) == 3)
        await d.close()

    asyncio.run(main())
    assert changes == [
        ({"10.0.0.1:9", "10.0.0.2:9"}, set()),
        ({"10.0.0.3:9"}, {"10.0.0.1:9"}),
        ({"[::1]:9"}, {"10.0.0.2:9", "10.0.0.3:9"}),
    ]


def test_a_hung_lookup_is_bounded_and_not_doubled() -> None:
    started = [0]
    release = asyncio.Event()

    async def resolve(host: str, port: int) -> list[str]:
        started[0] += 1
        await release.wait()
        return ["10.0.0.9"]

    async def main() -> frozenset[Replica]:
        d = Discovery(
            parse_peer_address("dns:///svc:9,127.0.0.1:5"), lambda a, r: None, timeout_s=0.05, resolve=resolve
        )
        found = await d.refresh()  # times out: the static replica is still found
        assert {r.address for r in found} == {"127.0.0.1:5"}
        await d.refresh()  # the first lookup is still running: no second one
        assert started[0] == 1
        release.set()
        await asyncio.sleep(0)
        found = await d.refresh()  # the lookup finished; a fresh one answers
        await d.close()
        return found

    assert {r.address for r in asyncio.run(main())} == {"127.0.0.1:5", "10.0.0.9:9"}


def test_the_system_resolver_answers_localhost() -> None:
    assert "127.0.0.1" in asyncio.run(resolve_all("localhost", 80))


async def _until(cond, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)
