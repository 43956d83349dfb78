"""Prompts are tokenized off the coordinator's event loop, in a bounded pool that admission counts."""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing
from pathlib import Path

import pytest

from coordinator.engine import RoundEngine
from coordinator.requests import prompt_ids
from specd.core.errors import ResourceExhausted
from specd.core.rounds.loop import GenerateSpec
from specd.core.sampling.sampler import SamplingParams
from specd.serving.config import CoordinatorConfig
from specd.v1 import coordinator_pb2
from tests.loop_fakes import FakeTarget
from tests.references import loaded


def _engine(**config: int) -> RoundEngine:
    # No replicas: off_loop and admission need neither (the engine is never started).
    return RoundEngine(CoordinatorConfig(**config), None, None, None)  # type: ignore[arg-type]


def test_tokenizing_runs_on_a_pool_thread_and_counts_for_admission() -> None:
    engine = _engine(max_concurrent_requests=2, tokenizer_threads=1)

    async def main() -> tuple[int, int]:
        started, release = threading.Event(), threading.Event()

        def slow() -> int:
            started.set()
            release.wait(10)
            return threading.get_ident()

        first = asyncio.ensure_future(engine.off_loop(slow))
        while not started.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the event loop runs on while the pool thread is held
        assert not first.done()
        engine.admit()  # one request preparing of two: room for another
        second = asyncio.ensure_future(engine.off_loop(threading.get_ident))  # queued behind the first
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="its limit of 2 requests"):
            engine.admit()  # both slots held by requests still being tokenized
        release.set()
        one, two = await first, await second
        engine.admit()  # done: room again
        return one, two

    loop_thread = threading.get_ident()
    one, two = asyncio.run(main())
    assert one != loop_thread and two == one  # one pool thread, not the loop's
    engine.stop_prompt_pool()


def test_an_abandoned_request_keeps_its_slot_until_its_peers_answered_the_close() -> None:
    target = FakeTarget()
    target.close_delay_s = 0.3  # the target is still busy with the request's last batch
    engine = RoundEngine(CoordinatorConfig(max_concurrent_requests=1), None, target, None)  # type: ignore[arg-type]
    spec = GenerateSpec(prompt_ids=[5, 17, 3], params=SamplingParams(temperature=0.0, seed=1), max_new_tokens=4)

    def admitted() -> bool:
        try:
            engine.admit()
            return True
        except ResourceExhausted:
            return False

    async def main() -> tuple[bool, bool, bool]:
        finished = engine.loop.run(spec, max_context=64, session_id="done")
        _ = [rec async for rec in finished.rounds()]
        after_finish = admitted()  # a finished request frees its slot at once: the next may follow
        abandoned = engine.loop.run(spec, max_context=64, session_id="gone")
        async with aclosing(abandoned.rounds()) as rounds:
            async for _rec in rounds:
                break  # the client went away after the first round
        while_closing = admitted()
        await engine.loop.drain()
        return after_finish, while_closing, admitted()

    assert asyncio.run(main()) == (True, False, True)
    engine.stop_prompt_pool()


def test_the_pool_gives_what_tokenizing_inline_gives(tiny_pair: tuple[Path, Path]) -> None:
    tiny_tokenizer = loaded(str(tiny_pair[0])).tokenizer
    engine = _engine()
    config = CoordinatorConfig()
    req = coordinator_pb2.GenerateRequest(text="hello there, " * 40)

    async def main() -> list[int]:
        return await engine.off_loop(lambda: prompt_ids(req, tiny_tokenizer, config, 259))

    assert asyncio.run(main()) == prompt_ids(req, tiny_tokenizer, config, 259)
    engine.stop_prompt_pool()
