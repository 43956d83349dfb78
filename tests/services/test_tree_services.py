"""Tree speculation through the three services (the shared tiny cluster): exact, and refused when malformed."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.core.sampling.sampler import SamplingParams
from specd.tools import cli
from tests.cluster import Cluster
from tests.references import reference
from tests.services.test_services import PROMPTS, prompt_ids

TREE = dict(speculation="fixed", draft_length=4, tree_budget=8, ignore_eos=True)


def test_greedy_and_seeded_trees_through_the_services(tiny_cluster: Cluster, tiny_pair: tuple[Path, Path]) -> None:
    """Greedy: target-only's tokens; seeded: the in-process loop's tree rounds, token for token."""
    target, draft = tiny_pair
    with tiny_cluster.client() as client:
        for text in PROMPTS[:3]:
            ids = prompt_ids(target, text)
            ref = reference(target, None, ids, SamplingParams(temperature=0), max_new_tokens=20)
            got = client.generate(ids, max_new_tokens=20, temperature=0, **TREE)
            assert list(got.token_ids) == ref.token_ids, text
            s = got.stats
            assert s.draft_tokens > s.drafts * 4 // 2  # trees of several nodes went out
            assert s.accepted_tokens + s.rounds == 20 and len(s.accepted_per_position) <= 4  # per depth
            streamed = list(client.generate_stream(ids, max_new_tokens=20, temperature=0, **TREE))
            assert [t for m in streamed for t in m.token_ids] == ref.token_ids
        params = SamplingParams(temperature=0.9, top_k=40, seed=7)
        ids = prompt_ids(target, PROMPTS[3])
        local = reference(target, draft, ids, params, max_new_tokens=20, draft_length=4, tree_budget=8)
        for _ in range(2):
            got = client.generate(ids, max_new_tokens=20, temperature=0.9, top_k=40, seed=7, **TREE)
            assert list(got.token_ids) == local.token_ids
            assert got.stats.accepted_tokens == local.stats.accepted_tokens
            assert got.stats.draft_tokens == local.stats.draft_tokens


@pytest.mark.parametrize(
    "options, needle",
    [
        (dict(tree_budget=10_000, speculation="fixed"), "tree_budget must be in 0..32"),
        (dict(tree_budget=8, speculation="auto"), "MODE_FIXED"),
        (dict(tree_budget=8, speculation="fixed", pipeline="spec-cache"), "PIPELINE_BONUS_MATCH"),
    ],
)
def test_malformed_tree_requests_get_invalid_argument(tiny_cluster: Cluster, options, needle) -> None:
    with tiny_cluster.client(timeout=30) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("hi", max_new_tokens=4, temperature=0, **options)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details(), err.value.details()


def test_specd_generate_tree_budget(tiny_cluster: Cluster, tiny_pair: tuple[Path, Path], capsys) -> None:
    """`specd generate --tree-budget N`: tree rounds (fixed, draft length 4), target-only's greedy text."""
    target, _ = tiny_pair
    args = ["generate", "--address", tiny_cluster.address, "--max-new-tokens", "12", "--temperature", "0"]
    ref = reference(target, None, prompt_ids(target, PROMPTS[0]), SamplingParams(temperature=0), max_new_tokens=12)
    for more in ([], ["--pipeline", "bonus-match"]):  # plain and pipelined trees (docs/trees.md)
        assert cli.main([*args, "--ignore-eos", "--json", "--tree-budget", "6", *more, PROMPTS[0]]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == ref.token_ids
        assert out["stats"]["draft_tokens"] > out["stats"]["drafts"]  # trees: several nodes per drafting round


def test_trees_at_the_limits_are_served_past_them_refused_and_every_service_stays_serving(
    tiny_cluster: Cluster, tiny_pair: tuple[Path, Path]
) -> None:
    """A tree at the node and depth limits (budget 32, depth 16: the defaults), plain and pipelined, gives
    target-only's tokens;
    one node or one level more is refused with INVALID_ARGUMENT (by the coordinator, before any draft
    or target allocates); afterwards all three services still answer SERVING."""
    target, _ = tiny_pair
    ids = prompt_ids(target, PROMPTS[1])
    ref = reference(target, None, ids, SamplingParams(temperature=0), max_new_tokens=12)
    limits = dict(speculation="fixed", ignore_eos=True)
    with tiny_cluster.client(timeout=60) as client:
        for pipeline in ("off", "bonus-match"):  # pipelined: a pre-draft of 32 nodes, 17 levels
            got = client.generate(
                ids, max_new_tokens=12, temperature=0, tree_budget=32, draft_length=16, pipeline=pipeline, **limits
            )
            assert list(got.token_ids) == ref.token_ids
        for over, needle in (
            (dict(tree_budget=33, draft_length=4), "tree_budget must be in 0..32"),
            (dict(tree_budget=8, draft_length=17), "draft_length must be in 1..16"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                client.generate(ids, max_new_tokens=4, temperature=0, **over, **limits)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in err.value.details(), err.value.details()
    for service in (tiny_cluster.coordinator, tiny_cluster.draft, tiny_cluster.target):
        assert service is not None and service.address
        with grpc.insecure_channel(service.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
