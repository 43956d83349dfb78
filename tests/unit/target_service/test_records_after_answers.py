"""A batch's spans and metrics are recorded after its answers went out, never before them.

The target servicer answers a verify, then records its message (metrics, span): at once when
nothing else is queued, or beside the next batch's pass when one is (round_servicing,
`record_answered`). Emulated target, no gRPC.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry

from specd.core.model.sim import parse_sim_spec
from specd.core.rounds import steps
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from specd.serving import wire
from specd.serving.batching import MicroBatcher
from specd.serving.metrics import TargetMetrics
from specd.serving.streams import Stamped
from specd.v1 import common_pb2, target_pb2
from target_service.servicer import TargetServicer

SPEC = "sim:h100-tp2-70b,vocab_size=512,time_scale=0"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PARAMS = SamplingParams(temperature=0.0, seed=7)


def _verifies(metrics: TargetMetrics) -> float:
    return metrics.registry.get_sample_value("specd:target_requests_total", {"op": "verify", "result": "ok"}) or 0.0


def _open(sid: str) -> target_pb2.TargetRequest:
    return wire.open_request(target_pb2.TargetRequest, steps.OpenRequest(sid, PROMPT, PARAMS), {})


def _verify(sid: str) -> target_pb2.TargetRequest:
    n = len(PROMPT)
    return wire.verify_request(steps.VerifyRequest(sid, n, Proposal([11, 12]), start=n), {})


def test_a_verify_is_recorded_after_its_answer_went_out_and_the_next_batchs_pass_records_it() -> None:
    metrics = TargetMetrics(CollectorRegistry())
    verifier = Verifier(parse_sim_spec(SPEC).runner("target"))
    seen_at_answer: dict[str, float] = {}  # session -> verifies recorded when its answer was delivered
    recorded_in_pass: list[tuple[float, float]] = []  # verifies recorded before and after each pass's `beside`
    answered = threading.Event()
    gate = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        servicer = TargetServicer(verifier, pool, common_pb2.ModelInfo(), metrics=metrics)
        real = verifier.runner.logits_batch

        def logits_batch(sessions: Any, num_last: Any, *, beside: Any = None) -> Any:
            def then() -> None:
                before = _verifies(metrics)
                beside()
                recorded_in_pass.append((before, _verifies(metrics)))

            return real(sessions, num_last, beside=then if beside is not None else None)

        verifier.runner.logits_batch = logits_batch  # type: ignore[method-assign]

        def deliver(items: list[tuple[Stamped[target_pb2.TargetRequest], Any]]) -> None:
            for stamped, resp in items:
                assert resp.WhichOneof("result") != "error", resp
                if stamped.request.WhichOneof("op") == "verify":
                    seen_at_answer[stamped.request.session_id] = _verifies(metrics)
                    if stamped.request.session_id == "a":
                        gate.wait(10)  # b's verify is queued before a's answer is handed on
            answered.set()

        def send(req: target_pb2.TargetRequest) -> None:
            servicer._submit([Stamped(req, time.perf_counter_ns(), deliver=deliver)], deliver)

        for sid in ("a", "b"):
            send(_open(sid))
        send(_verify("a"))
        deadline = time.monotonic() + 10
        while "a" not in seen_at_answer and time.monotonic() < deadline:
            time.sleep(0.005)
        send(_verify("b"))  # queued while a's answer is being handed on
        gate.set()
        deadline = time.monotonic() + 10
        while _verifies(metrics) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert seen_at_answer == {"a": 0.0, "b": 1.0}  # neither counted before its own answer went out
    # b's pass recorded a's verify beside it; b's was recorded after its answer, with nothing queued
    assert recorded_in_pass[-1] == (0.0, 1.0) and _verifies(metrics) == 2.0


def test_the_batcher_says_after_each_delivery_whether_more_is_queued() -> None:
    calls: list[tuple[str, bool]] = []
    gate = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:

        def handle(batch: list[int]) -> list[int]:
            if batch == [1]:
                gate.wait(10)  # 2 arrives while 1 runs
            return [x * 10 for x in batch]

        batcher: MicroBatcher[int, int] = MicroBatcher(
            handle, pool, after_deliver=lambda queued: calls.append(("after", queued))
        )
        done = threading.Event()

        def deliver(items: list[tuple[int, Any]]) -> None:
            calls.extend(("answer", r == 20) for _, r in items)
            if any(r == 20 for _, r in items):
                done.set()

        batcher.submit([1], deliver)
        batcher.submit([2], deliver)
        gate.set()
        assert done.wait(10)
        deadline = time.monotonic() + 10
        while len(calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
    # 1's answer, then "2 is queued"; 2's answer, then "nothing is"
    assert calls == [("answer", False), ("after", True), ("answer", True), ("after", False)]
