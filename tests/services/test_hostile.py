"""Hostile requests beside ordinary ones, through the real services: the ordinary ones never notice.

The cluster serves models with one poisoned embedding row (NaN): a prompt that
holds that token makes its row's numbers NaN in the draft and in the target,
the closest a test can come to "a request whose numbers blow up" (what a
temperature of 1e-45 once did). The poisoned token is one that the ordinary
requests never touch: their runs are deterministic (seeded coins, batch-
independent), so an in-process run that records every token either model
sees tells which tokens are safe.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from coordinator.client import CoordinatorClient
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.inprocess import speculative_generate
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from specd.v1 import session_pb2, target_pb2, target_pb2_grpc
from tests.cluster import Cluster
from tests.round_messages import answers, one_per_message

MAX_NEW = 12
K = 3
SHORT_DEADLINE_S = 0.05
ORDINARY = [
    ("hello world", 0.0, 1),
    ("def f(x):\n    return", 0.7, 2),
    ("abcabcabc", 0.0, 3),
    ("The end.", 0.7, 4),
    ("speculative", 0.0, 5),
    ("0123456789", 0.7, 6),
    ("a longer prompt here", 0.0, 7),
    ("xyz", 0.7, 8),
]


class _RecordingRunner(CausalLMRunner):
    """A real runner that notes every token id that enters a forward pass."""

    def __init__(self, model, seen: set[int]) -> None:
        super().__init__(model)
        self.seen = seen

    def logits(self, s, num_last):  # type: ignore[no-untyped-def]
        self.seen.update(s.tokens)
        return super().logits(s, num_last)

    def logits_batch(self, sessions, num_last, *, beside=None):  # type: ignore[no-untyped-def]
        for s in sessions:
            self.seen.update(s.tokens)
        return super().logits_batch(sessions, num_last, beside=beside)


def _run(target, draft, prompt: list[int], params: SamplingParams, seen: set[int], k: int = K) -> list[int]:
    verifier = Verifier(_RecordingRunner(target.model, seen))
    drafter = ModelDrafter(_RecordingRunner(draft.model, seen)) if k else None
    return speculative_generate(
        prompt,
        verifier,
        drafter,
        params,
        draft_length=k,
        max_new_tokens=MAX_NEW,
        stop_token_ids=(),
        opening="draft-first",  # as the cluster below opens
    ).token_ids


def _poison(folder: Path, out: Path, token: int) -> Path:
    loaded = load_pretrained(folder)
    with torch.no_grad():
        loaded.model.get_input_embeddings().weight[token] = float("nan")
    loaded.model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def plan(tiny_pair: tuple[Path, Path]) -> dict:
    """The ordinary requests' exact outputs, and a token none of them ever feeds to a model."""
    target, draft = (load_pretrained(f) for f in tiny_pair)
    seen: set[int] = set()
    want = [_run(target, draft, list(p.encode()), SamplingParams(temperature=t, seed=s), seen) for p, t, s in ORDINARY]
    greedy = _run(target, draft, list(b"tiny"), SamplingParams(temperature=0.0, seed=9), seen, k=0)
    safe = sorted(set(range(128, 256)) - seen)  # bytes no ASCII prompt holds
    assert safe, "every byte was touched; pick other prompts"
    return {"want": want, "greedy": greedy, "poison": safe[-1]}


@pytest.fixture(scope="module")
def poisoned_pair(
    tiny_pair: tuple[Path, Path], plan: dict, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("poisoned")
    return (
        _poison(tiny_pair[0], root / "target", plan["poison"]),
        _poison(tiny_pair[1], root / "draft", plan["poison"]),
    )


@pytest.fixture(scope="module")
def cluster(poisoned_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    target, draft = poisoned_pair
    # A long draft pause: a wrongly paused draft would show in the ordinary requests' stats.
    # Draft first: the poisoned request must reach the draft's refusal before the target fails on
    # the same NaN row; opening beside, the target's prefill races the draft's (it lost in a CI run).
    args = ["--draft-retry-s", "60", "--opening", "draft-first"]
    with Cluster(target, draft, cache_dir=tmp_path_factory.mktemp("cache"), coordinator_args=args) as c:
        yield c


def _ordinary(client: CoordinatorClient, prompt: str, temperature: float, seed: int):
    return client.generate(
        prompt,
        max_new_tokens=MAX_NEW,
        temperature=temperature,
        seed=seed,
        ignore_eos=True,
        speculation="fixed",
        draft_length=K,
    )


def _short_deadline_caller(client: CoordinatorClient, i: int, done: threading.Event) -> list[grpc.StatusCode]:
    """Requests that cannot finish in SHORT_DEADLINE_S, one after another until `done`: their status codes."""
    codes = []
    while not done.is_set() or not codes:
        try:
            client.generate(f"little time {i} " * 8, max_new_tokens=64, ignore_eos=True, speculation="fixed")
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                time.sleep(SHORT_DEADLINE_S)  # "retry later", as a client would: no spinning on refusals
    return codes


def _timed(call: Callable[[], object]) -> tuple[object, float]:
    """(result or the RpcError raised, seconds)."""
    t0 = time.monotonic()
    try:
        result = call()
    except grpc.RpcError as err:
        result = err
    return result, time.monotonic() - t0


def _hostile_verify(address: str, k: int, width: int) -> session_pb2.SessionError:
    """An internal Verify sent straight to the target (after an honest open): K draft tokens, q of `width` entries."""
    sid = f"hostile-{k}-{width}"
    opening = target_pb2.TargetRequest(request_id=1, session_id=sid, committed_length=1)
    opening.open.token_ids.append(1)
    opening.open.sampling.seed = 1
    req = target_pb2.TargetRequest(request_id=2, session_id=sid, committed_length=1)
    req.verify.start = 1
    req.verify.draft_token_ids.extend([1] * k)
    if width:
        q = req.verify.q.add()
        q.token_ids.extend(range(width))
        q.probs.extend([1.0] * width)
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        try:
            stream = target_pb2_grpc.TargetStub(channel).Rounds(one_per_message([opening, req]), timeout=60)
            responses = list(answers(stream))
        except grpc.RpcError as err:  # over the target's message limit: refused unread, this stream only
            return session_pb2.SessionError(code=session_pb2.SessionError.CODE_RESOURCE_EXHAUSTED, message=str(err))
    by_id = {r.request_id: r for r in responses}
    assert by_id[1].WhichOneof("result") == "ack", by_id[1]
    assert by_id[2].WhichOneof("result") == "error", by_id[2]
    return by_id[2].error


def test_hostile_requests_fail_alone_beside_eight_ordinary_ones(cluster: Cluster, plan: dict) -> None:
    want, greedy, poison = plan["want"], plan["greedy"], plan["poison"]

    short = CoordinatorClient(cluster.address, timeout=SHORT_DEADLINE_S)
    with cluster.client(timeout=120) as client, short, ThreadPoolExecutor(32) as pool:
        hostile_calls: dict[str, Callable[[], object]] = {
            "tiny temperature": lambda: client.generate(
                "tiny", max_new_tokens=MAX_NEW, temperature=1e-45, seed=9, ignore_eos=True, speculation="fixed"
            ),
            "nan temperature": lambda: client.generate("x", max_new_tokens=4, temperature=math.nan),
            "nan top_p": lambda: client.generate("x", max_new_tokens=4, temperature=0.7, top_p=math.nan),
            "nan min_p": lambda: client.generate("x", max_new_tokens=4, temperature=0.7, min_p=math.nan),
            "huge temperature": lambda: client.generate("x", max_new_tokens=4, temperature=3e38),
            "nan numbers": lambda: client.generate(
                [104, 105, poison, 33], max_new_tokens=4, temperature=0.7, speculation="fixed", draft_length=K
            ),
            "verify K=10000": lambda: _hostile_verify(cluster.target.address, 10_000, 0),
            "verify width=100000": lambda: _hostile_verify(cluster.target.address, 1, 100_000),
            "verify width=1000000": lambda: _hostile_verify(cluster.target.address, 1, 1_000_000),
        }
        # 16 callers that send 50 ms-deadline requests, one after the other, for as long as the
        # ordinary requests run: their own deadlines cut their draft calls short, which must
        # pause nobody else's drafting (it did: the draft counted as failed for everyone)
        ordinary_done = threading.Event()
        short_codes = [pool.submit(_short_deadline_caller, short, i, ordinary_done) for i in range(16)]
        ordinary = [pool.submit(_ordinary, client, p, t, s) for p, t, s in ORDINARY]
        hostile = {name: pool.submit(_timed, call) for name, call in hostile_calls.items()}
        got = [f.result(timeout=300) for f in ordinary]
        ordinary_done.set()
        outcomes = {name: f.result(timeout=300) for name, f in hostile.items()}
        codes = [code for f in short_codes for code in f.result(timeout=60)]

    print("seconds per hostile call:", {name: round(seconds, 3) for name, (_, seconds) in outcomes.items()})
    for reply, expect in zip(got, want):
        assert list(reply.token_ids) == expect
        assert reply.stats.draft_tokens > 0 and reply.stats.target_only_rounds == 0  # the draft never paused
    tiny, _ = outcomes.pop("tiny temperature")
    assert list(tiny.token_ids) == greedy  # below the floor: greedy, exact
    for name in ("nan temperature", "nan top_p", "nan min_p", "huge temperature"):
        err, _ = outcomes.pop(name)
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err)
    err, _ = outcomes.pop("nan numbers")
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INTERNAL, err
    assert "logged" in err.details() and "finite" not in err.details()  # a generic message, details in the log
    # An abandoned request keeps its admission slot until its peers answered the close
    # (coordinator/engine.py, admit): when the flood outruns the closes, the next call is refused
    # at once (RESOURCE_EXHAUSTED), never queued. How often depends on the machine's load (1 of 589
    # calls in one run here; 2,466 of 2,927 in a CI run whose callers retried without a pause), so
    # the check is that refusals are the only other outcome and that many calls ran into their deadline.
    expired = codes.count(grpc.StatusCode.DEADLINE_EXCEEDED)
    assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}, set(codes)
    assert expired >= 16, (expired, len(codes))
    # 7 MB of q is over the target's message limit (sized to its context and q caps): gRPC
    # refuses that stream unread. Within the limit, the size check answers in-band.
    huge, _ = outcomes.pop("verify width=1000000")
    assert huge.code == session_pb2.SessionError.CODE_RESOURCE_EXHAUSTED, huge
    for name, (error, _) in outcomes.items():
        assert error.code == session_pb2.SessionError.CODE_INVALID_ARGUMENT, (name, error)

    log = "".join(cluster.coordinator.lines)
    assert "retrying" not in log, log[-3000:]  # no retry loop: a request's own errors are not retried
    assert "draft failed" not in log, log[-3000:]  # ... and never pause the draft for everyone
    assert "draft refused session" in log, log[-3000:]  # the poisoned request went target-only alone
