"""The three services end to end, as separate processes on 127.0.0.1 (tiny models)."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specd.core.sampling.sampler import SamplingParams
from specd.v1 import common_pb2
from tests.cluster import Cluster, metrics_address, scrape, total
from tests.references import loaded, reference

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "SELECT name FROM users WHERE",
    "To be, or not to be",
    "import numpy as np\n",
    "Dear diary, today",
    "1, 1, 2, 3, 5, 8,",
]


def prompt_ids(target: Path, text: str) -> list[int]:
    return list(loaded(str(target)).tokenizer(text, add_special_tokens=False).input_ids)


@pytest.fixture()
def cluster(tiny_cluster: Cluster) -> Cluster:
    return tiny_cluster


@pytest.mark.device  # services on SPECD_TEST_DEVICE (tiny_cluster), reference on the CPU
def test_greedy_generate_and_stream_equal_target_only(cluster: Cluster, tiny_pair: tuple[Path, Path]) -> None:
    target, _ = tiny_pair
    with cluster.client() as client:
        for k, text in zip([1, 4, 8, 4, 2, 6, 3, 5], PROMPTS):
            ids = prompt_ids(target, text)
            ref = reference(target, None, ids, SamplingParams(temperature=0), max_new_tokens=24)
            unary = client.generate(
                ids, max_new_tokens=24, temperature=0, ignore_eos=True, speculation="fixed", draft_length=k
            )
            assert list(unary.token_ids) == ref.token_ids, text
            assert unary.stats.draft_tokens > 0 and unary.stats.completion_tokens == 24
            streamed = list(
                client.generate_stream(
                    ids, max_new_tokens=24, temperature=0, ignore_eos=True, speculation="fixed", draft_length=k
                )
            )
            assert [t for m in streamed for t in m.token_ids] == ref.token_ids
            assert streamed[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert len(streamed) == streamed[-1].stats.rounds  # one message per committed round
            assert "".join(m.text for m in streamed) == unary.text


def test_seeded_sampling_equals_in_process_loop(cluster: Cluster, tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    with cluster.client() as client:
        for seed, (temperature, top_k, top_p) in enumerate([(0.8, 0, 1.0), (1.0, 20, 0.9), (1.5, 0, 0.95)]):
            ids = prompt_ids(target, PROMPTS[seed])
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + 11)
            ref = reference(target, draft, ids, params, max_new_tokens=20, draft_length=4)
            sampling = dict(max_new_tokens=20, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + 11)
            fixed = dict(speculation="fixed", draft_length=4)
            got = client.generate(ids, ignore_eos=True, **sampling, **fixed)
            assert list(got.token_ids) == ref.token_ids
            assert got.stats.accepted_tokens == ref.stats.accepted_tokens
            assert list(client.generate(ids, ignore_eos=True, **sampling, **fixed).token_ids) == ref.token_ids
            # The default (auto, its pipeline auto): a chosen seed keeps K at the default 4, so the
            # output is fixed-4's whatever auto measured (the pipeline it picks does not change it).
            assert list(client.generate(ids, ignore_eos=True, **sampling).token_ids) == ref.token_ids


def test_spec_cache_gives_the_tokens_of_no_pipelining(cluster: Cluster, tiny_pair: tuple[Path, Path]) -> None:
    """The speculation cache through the services: greedy is target-only's output; seeded sampling is the
    in-process loop's, which is the output without pipelining (a hit drafts what a fresh propose would)."""
    target, draft = tiny_pair
    options = dict(max_new_tokens=20, ignore_eos=True, speculation="fixed", draft_length=3, pipeline="spec-cache")
    with cluster.client() as client:
        for i, text in enumerate(PROMPTS[:3]):
            ids = prompt_ids(target, text)
            greedy = reference(target, None, ids, SamplingParams(temperature=0), max_new_tokens=20)
            got = client.generate(ids, temperature=0, **options)
            assert list(got.token_ids) == greedy.token_ids and got.stats.draft_tokens > 0
            params = SamplingParams(temperature=0.9, top_k=40, seed=i + 5)
            plain = reference(target, draft, ids, params, max_new_tokens=20, draft_length=3)
            cached = reference(target, draft, ids, params, max_new_tokens=20, draft_length=3, pipeline="spec-cache")
            assert cached.token_ids == plain.token_ids
            for _ in range(2):  # seeded: reproducible
                got = client.generate(ids, temperature=0.9, top_k=40, seed=i + 5, **options)
                assert list(got.token_ids) == plain.token_ids


def test_sixteen_concurrent_streams_do_not_cross_talk(cluster: Cluster, tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    cases = []
    for i in range(16):
        ids = prompt_ids(target, PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)))
        temperature = 0.0 if i % 2 == 0 else 0.9
        params = SamplingParams(temperature=temperature, seed=100 + i)
        k = 1 + i % 5
        expected = reference(target, draft, ids, params, max_new_tokens=16, draft_length=k).token_ids
        cases.append((ids, temperature, 100 + i, k, expected))

    def run(case):
        ids, temperature, seed, k, _ = case
        with cluster.client() as client:
            msgs = list(
                client.generate_stream(
                    ids,
                    max_new_tokens=16,
                    temperature=temperature,
                    seed=seed,
                    ignore_eos=True,
                    speculation="fixed",
                    draft_length=k,
                )
            )
        return [t for m in msgs for t in m.token_ids]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, cases))
    for case, got in zip(cases, results):
        assert got == case[4]


def test_reflection_and_health(cluster: Cluster) -> None:
    for address in (cluster.address, cluster.target.address, cluster.draft.address):  # type: ignore[union-attr]
        with grpc.insecure_channel(address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert "grpc.health.v1.Health" in services
            assert services & {"specd.v1.Coordinator", "specd.v1.Draft", "specd.v1.Target"}
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_invalid_requests_get_invalid_argument(cluster: Cluster) -> None:
    with cluster.client(timeout=30) as client:
        cases = [
            (dict(prompt=""), "empty"),
            (dict(prompt=[10**6]), "outside the vocabulary"),
            (dict(prompt="hi", temperature=-1.0), "temperature"),
            (dict(prompt="hi", top_p=1.5), "top_p"),
            (dict(prompt="hi", max_new_tokens=10**7), "max_new_tokens"),
            (dict(prompt=[{"role": "robot", "content": "x"}]), "role"),
        ]
        for kwargs, needle in cases:
            prompt = kwargs.pop("prompt")
            with pytest.raises(grpc.RpcError) as err:
                client.generate(prompt, **kwargs)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (kwargs, err.value.details())
            assert needle in err.value.details(), err.value.details()
        assert client.generate("still serving", max_new_tokens=2, temperature=0).stats.completion_tokens == 2


def test_draft_killed_mid_request_and_target_restarted(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = tiny_pair
    ids = prompt_ids(target, PROMPTS[0])
    ref = reference(target, None, ids, SamplingParams(temperature=0), max_new_tokens=120).token_ids
    with Cluster(target, draft, cache_dir=tmp_path) as c, c.client() as client:
        assert c.draft is not None
        # Kill the draft while a request streams: the request finishes, exactly, target-only.
        got: list[int] = []
        stream = client.generate_stream(
            ids, max_new_tokens=120, temperature=0, ignore_eos=True, speculation="fixed", draft_length=4
        )
        for i, msg in enumerate(stream):
            got.extend(msg.token_ids)
            if i == 2:
                c.draft.kill()
        assert got == ref, c.logs()
        assert msg.stats.target_only_rounds > 0 and msg.stats.draft_tokens > 0
        # The draft comes back: speculation resumes.
        c.draft.restart(c.env)
        deadline = time.monotonic() + 60
        while True:
            resp = client.generate(
                ids, max_new_tokens=30, temperature=0, ignore_eos=True, speculation="fixed", draft_length=4
            )
            assert list(resp.token_ids) == ref[:30]
            if resp.stats.target_only_rounds == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert resp.stats.target_only_rounds == 0, c.logs()
        # Restart the target between requests: the next request heals its sessions.
        c.target.kill()
        c.target.restart(c.env)
        resp = client.generate(
            ids, max_new_tokens=30, temperature=0, ignore_eos=True, speculation="fixed", draft_length=4
        )
        assert list(resp.token_ids) == ref[:30], c.logs()


def test_sigterm_lets_in_flight_request_finish(
    tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, tmp_path: Path
) -> None:
    """SIGTERM drains: the coordinator finishes its in-flight request. A draft, whose round stream is one call that
    never ends by itself, serves the request's rounds until its session closes and then ends the stream, so it
    exits long before its grace; the tokens are target-only greedy's."""
    target, draft = tiny_pair
    ids = prompt_ids(target, PROMPTS[1])
    greedy = reference(target, None, ids, SamplingParams(temperature=0.0), max_new_tokens=150)
    c = Cluster(target, draft, cache_dir=tmp_path, draft_args=["--grace-s", "120"], borrow_target=tiny_cluster).start()
    try:
        assert c.coordinator is not None and c.draft is not None
        client = c.client()
        result: dict[str, object] = {}

        def call() -> None:
            try:
                result["resp"] = client.generate(
                    ids, max_new_tokens=150, temperature=0, ignore_eos=True, speculation="fixed", draft_length=3
                )
            except grpc.RpcError as exc:
                result["err"] = exc

        worker = threading.Thread(target=call)
        worker.start()
        target_metrics = metrics_address(c.target)  # the session's target serves metrics
        deadline = time.monotonic() + 30  # the signals come while the request runs: its session is open
        while total(scrape(target_metrics), "specd:sessions_active") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        signalled = time.monotonic()
        c.draft.signal(signal.SIGTERM)
        c.coordinator.signal(signal.SIGTERM)  # both while the request runs
        worker.join(60)
        assert not worker.is_alive()
        assert c.draft.proc is not None
        assert c.draft.proc.wait(max(1.0, 60 - (time.monotonic() - signalled))) == 0  # not the 120 s grace
        assert "resp" in result, result.get("err")
        assert list(result["resp"].token_ids) == greedy.token_ids  # type: ignore[attr-defined]
        assert c.coordinator.proc is not None and c.coordinator.proc.wait(30) == 0
        client.close()
    finally:
        c.stop()


def test_pipelining_and_auto_give_the_same_tokens(
    tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, tmp_path: Path
) -> None:
    """Bonus-match pipelining is exact and changes no token; post-verify pipelining gives target-only's greedy
    tokens, and sampled, the in-process loop's tokens; automatic K is exact (greedy)."""
    target, _ = tiny_pair
    cluster = Cluster(target, target, cache_dir=tmp_path, borrow_target=tiny_cluster)  # the target drafts for itself
    with cluster as c, c.client() as client:
        hits = post_hits = auto_drafted = cache_hits = 0
        for seed, text in enumerate(PROMPTS[:4]):
            ids = prompt_ids(target, text)
            for temperature in (0.0, 0.8):
                params = SamplingParams(temperature=temperature, seed=seed)
                ref = reference(target, target, ids, params, max_new_tokens=24, draft_length=3)
                got = client.generate(
                    ids,
                    max_new_tokens=24,
                    temperature=temperature,
                    seed=seed,
                    ignore_eos=True,
                    speculation="fixed",
                    draft_length=3,
                    pipeline=True,
                )
                assert list(got.token_ids) == ref.token_ids
                hits += got.stats.pipeline_hits
                cached = client.generate(
                    ids,
                    max_new_tokens=24,
                    temperature=temperature,
                    seed=seed,
                    ignore_eos=True,
                    speculation="fixed",
                    draft_length=3,
                    pipeline="spec-cache",
                )
                assert list(cached.token_ids) == ref.token_ids
                assert sum(cached.stats.pipeline_hits_by_outcome.values()) == cached.stats.pipeline_hits
                cache_hits += cached.stats.pipeline_hits
            greedy = reference(target, None, ids, SamplingParams(temperature=0), max_new_tokens=24)
            post = [
                client.generate(
                    ids,
                    max_new_tokens=24,
                    temperature=t,
                    seed=seed,
                    ignore_eos=True,
                    speculation="fixed",
                    draft_length=3,
                    pipeline="post-verify",
                )
                for t in (0.0, 0.8, 0.8)
            ]
            assert list(post[0].token_ids) == greedy.token_ids
            assert list(post[1].token_ids) == list(post[2].token_ids) and len(post[1].token_ids) == 24
            # the services run the in-process loop's rounds: post-verify sampling gives its very tokens
            sampled = SamplingParams(temperature=0.8, seed=seed)
            in_process = reference(
                target, target, ids, sampled, max_new_tokens=24, draft_length=3, pipeline="post-verify"
            )
            assert list(post[1].token_ids) == in_process.token_ids
            post_hits += post[0].stats.pipeline_hits
            auto = client.generate(ids, max_new_tokens=24, temperature=0, ignore_eos=True, speculation="auto")
            assert list(auto.token_ids) == greedy.token_ids
            auto_drafted += auto.stats.draft_tokens
        # The target drafting for itself costs as much as it saves (c ~ 1), so automatic K rightly turns
        # speculation off once it has measured that; only the first request (optimistic priors) must draft.
        assert hits > 0 and post_hits > 0 and auto_drafted > 0 and cache_hits > 0
