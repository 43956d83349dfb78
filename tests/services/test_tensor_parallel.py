"""Tensor-parallel target on CPU with gloo: same logits and tokens as tp=1, 1/N weights, failure.

Two layers: rank 0 in this process with one `mp` follower (tp=2 on the pair's
target: chain and tree logits, tree rounds for each drafter, weight bytes, a
killed worker); and the three services as processes (chain and tree tokens),
the target with `--tp 3 --executor mp` on the tiny target that shards by 3
(specd.tools.tiny_models.build_tiny_target_tp3; the pair's does not), then
`--tp 2 --executor ray` on the pair's target (EXECUTOR_TP says why), on a
local Ray this module starts with a capped object store; the pair's draft
drafts for both. Every follower start is a fresh interpreter (~3.7 CPU-s on
these 2 cores), hence no more ranks than that. The sharding rules:
tests/unit/core/model/test_tensor_parallel_shapes.py.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.ngram import NgramDrafter
from specd.core.draft.protocol import Drafter
from specd.core.draft.suffix import SuffixDrafter
from specd.core.errors import InvalidArgument, Unavailable
from specd.core.inprocess import speculative_generate, speculative_generate_batch
from specd.core.model import tensor_parallel
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.rounds.steps import TreeVerifyRequest, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.sampling.tree import DraftTree
from specd.core.target.verifier import Verifier
from specd.tools.tiny_models import build_tiny_target_tp3
from specd.v1 import common_pb2, session_pb2, target_pb2, target_pb2_grpc
from target_service.servicer import TargetServicer
from target_service.workers.commands import Command
from target_service.workers.tp_runner import TensorParallelRunner, build_tp_runner
from tests.cluster import READY_TIMEOUT_S, Cluster, QuietService, metrics_address, scrape, total
from tests.references import loaded, reference
from tests.round_messages import answers, one_per_message

pytestmark = pytest.mark.timeout(240)

TP = 2  # rank 0 in this process
# The services' target per executor: tp=3 (on build_tiny_target_tp3) or 2 (on the pair's target). Ray
# stays at 2: at 3 its tests pass too, but placing two actors on the 2-CPU local Ray, and again after the
# kill, cost ~5 s more on the 2-core CI machine; the executors share the protocol (workers/commands.py).
EXECUTOR_TP = {"mp": 3, "ray": 2}
TOL = 1e-4  # max abs difference between tp=N and tp=1 logits
RECOVERY_TIMEOUT_S = 90.0
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "To be, or not to be", "1, 1, 2, 3, 5, 8,"]


def _ids(target: Path, text: str) -> list[int]:
    return list(loaded(str(target)).tokenizer(text, add_special_tokens=False).input_ids)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


# ---- rank 0 in this process, one mp follower ------------------------------------------


@pytest.fixture(scope="module")
def tp_runner(tiny_pair: tuple[Path, Path]) -> Iterator[TensorParallelRunner]:
    _, runner = build_tp_runner(tiny_pair[0], tp=TP, executor="mp", torch_threads=1, ready_timeout_s=120)
    try:
        yield runner
    finally:
        runner.group.shutdown()


@pytest.fixture(scope="module")
def tp1_runner(tiny_pair: tuple[Path, Path]) -> CausalLMRunner:
    return CausalLMRunner(load_pretrained(tiny_pair[0]).model)


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


def test_tp2_logits_match_tp1_after_prefill_verify_and_rollback(
    tp_runner: TensorParallelRunner, tp1_runner: CausalLMRunner
) -> None:
    rng = random.Random(3)
    assert tp_runner.vocab_size == tp1_runner.vocab_size
    prompt = [rng.randrange(tp1_runner.vocab_size) for _ in range(11)]
    a, b = tp_runner.new_session(prompt), tp1_runner.new_session(prompt)
    steps = []

    def both(fn, *args) -> None:
        fn(tp_runner, a, *args)
        fn(tp1_runner, b, *args)

    def compare(num_last: int, what: str) -> None:
        diff = _close(tp_runner.logits(a, num_last), tp1_runner.logits(b, num_last))
        steps.append((what, diff))
        assert diff <= TOL, f"{what}: tp={TP} logits differ from tp=1 by {diff:.3g}"

    compare(1, "prefill")
    for _ in range(3):  # decode
        both(CausalLMRunner.append, [int(tp1_runner.logits(b)[-1].argmax())])
        compare(1, "decode")
    committed = len(b.tokens)
    both(CausalLMRunner.append, [rng.randrange(tp1_runner.vocab_size) for _ in range(5)])
    compare(6, "verify K=5")
    both(CausalLMRunner.truncate, committed + 2)  # 2 accepted
    both(CausalLMRunner.append, [7])  # the recovered token
    compare(1, "after roll back")
    both(CausalLMRunner.truncate, 3)  # deep roll back, then re-verify from there
    both(CausalLMRunner.append, [1, 2, 3, 4])
    compare(5, "deep roll back + verify")
    both(CausalLMRunner.splice, 0, prompt[:6] + [9, 9])  # prefix edit keeps the common cache
    compare(2, "splice from the start")
    print("max |logits(tp=2) - logits(tp=1)|:", ", ".join(f"{w} {d:.2g}" for w, d in steps))
    tp_runner.release(a)


def test_tp2_batched_forward_matches_tp1_and_keeps_followers_in_step(
    tp_runner: TensorParallelRunner, tp1_runner: CausalLMRunner
) -> None:
    """Sessions of different lengths through one batched forward on both ranks, then a rollback
    and another batch, then a single-session forward: all within TOL of tp=1."""
    rng = random.Random(5)
    prompts = [[rng.randrange(tp1_runner.vocab_size) for _ in range(n)] for n in (3, 9, 14)]
    tp = [tp_runner.new_session(p) for p in prompts]
    one = [tp1_runner.new_session(p) for p in prompts]

    def compare(num_last: list[int], what: str) -> None:
        got = tp_runner.logits_batch(tp, num_last)
        want = tp1_runner.logits_batch(one, num_last)
        for g, w in zip(got, want):
            assert _close(g, w) <= TOL, what

    compare([1, 1, 1], "batched prefill")
    for runner, sessions in ((tp_runner, tp), (tp1_runner, one)):
        for i, s in enumerate(sessions):
            runner.append(s, [7 + i] * (i + 1))  # different K per session
    compare([2, 3, 4], "batched verify")
    for runner, sessions in ((tp_runner, tp), (tp1_runner, one)):
        runner.truncate(sessions[1], len(sessions[1].tokens) - 2)  # a rejection: roll back two
        runner.append(sessions[1], [5])
    compare([1, 1, 1], "batched after roll back")
    assert _close(tp_runner.logits(tp[2], 1), tp1_runner.logits(one[2], 1)) <= TOL  # followers still in step
    for s in tp:
        tp_runner.release(s)


def _random_tree(rng: random.Random, nodes: int, vocab: int, max_depth: int = 5) -> DraftTree:
    """`nodes` nodes, each under a random earlier node (or the prefix) at most max_depth deep."""
    parents: list[int] = []
    depths: list[int] = []
    for i in range(nodes):
        p = rng.choice([-1] + [j for j in range(i) if depths[j] < max_depth])
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
    return DraftTree.from_wire([rng.randrange(vocab) for _ in range(nodes)], parents, [], vocab)


def test_tree_logits_match_tp1_and_kept_paths_keep_followers_in_step(
    tp_runner: TensorParallelRunner, tp1_runner: CausalLMRunner
) -> None:
    """Four sessions (uncached, cached, partly cached, rolled back) verify trees of 9, 0, 4 and 13
    nodes in one tree forward, keep a path each (one after a rollback since the pass: tokens only),
    then one session alone verifies another tree (one-session pass) and keeps a path: every tree row
    and the chain forwards after the keeps (which run over the kept nodes' KV on every rank) within
    TOL of tp=1."""
    rng = random.Random(7)
    vocab = tp1_runner.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (6, 11, 4, 9)]
    tp = [tp_runner.new_session(p) for p in prompts]
    one = [tp1_runner.new_session(p) for p in prompts]
    for runner, (_, cached, partly, rolled) in ((tp_runner, tp), (tp1_runner, one)):
        runner.logits_batch([cached, partly, rolled], [1, 1, 1])
        runner.append(partly, [3, 4, 5])
        runner.truncate(rolled, 5)
        runner.append(rolled, [8, 9])
    trees = [_random_tree(rng, n, vocab) for n in (9, 0, 4, 13)]
    paths = [rng.choice(t.paths()) if len(t) else [] for t in trees]
    assert any(len(p) >= 2 for p in paths)

    def tree_round(idx: list[int], what: str, behind: int = -1) -> None:
        got = tp_runner.tree_logits_batch([tp[i] for i in idx], [trees[i] for i in idx])
        want = tp1_runner.tree_logits_batch([one[i] for i in idx], [trees[i] for i in idx])
        for i, g, w in zip(idx, got, want):
            assert _close(g.logits, w.logits) <= TOL, f"{what}: session {i}"
            if i == behind:  # rolled back and refilled since the pass: its cache fell behind
                for runner, x in ((tp_runner, tp[i]), (tp1_runner, one[i])):
                    tail = x.tokens[-2:]
                    runner.truncate(x, len(x.tokens) - 2)
                    runner.append(x, tail)
            tp_runner.keep_tree_path(tp[i], g, paths[i])
            tp1_runner.keep_tree_path(one[i], w, paths[i])
            for runner, s in ((tp_runner, tp[i]), (tp1_runner, one[i])):
                runner.append(s, [11 + i])  # the verdict's one more token

    tree_round([0, 1, 2, 3], "batched tree pass", behind=2)
    assert len(tp_runner._kept) == 2  # sessions 0 and 3: a kept path with its KV; 2 fell behind, 1 kept nothing
    assert tp[3].cached == len(tp[3].tokens) - 1  # prefix + kept path cached, as on the followers
    trees[3] = _random_tree(rng, 7, vocab)
    paths[3] = max(trees[3].paths(), key=len)
    tree_round([3], "one-session tree pass after the keeps")  # carries the first round's keeps
    assert tp_runner._kept  # the last keep waits for the next command
    got = tp_runner.logits_batch(tp, [1, 1, 1, 1])  # ... which carries it: cached columns only on every rank
    assert not tp_runner._kept
    for i, (g, w) in enumerate(zip(got, tp1_runner.logits_batch(one, [1, 1, 1, 1]))):
        assert _close(g, w) <= TOL, f"chain forward after the kept path: session {i}"
    assert [s.tokens for s in tp] == [s.tokens for s in one]
    for s in tp:
        tp_runner.release(s)


def test_bad_trees_raise_invalid_argument_before_any_collective(
    tp_runner: TensorParallelRunner, tp1_runner: CausalLMRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = tp_runner.group
    sent: list[Command] = []
    send = group.send

    def record(command: Command) -> None:
        sent.append(command)
        send(command)

    monkeypatch.setattr(group, "send", record)
    s, ref = tp_runner.new_session([1, 2, 3]), tp1_runner.new_session([1, 2, 3])
    vocab, restarts = tp_runner.vocab_size, group.restarts
    long = tp_runner.new_session([5] * (tp_runner.max_context - 1))
    bad: list[tuple[list[KVSession], list[DraftTree], str]] = [
        ([s], [DraftTree((1, vocab), (-1, 0))], "outside the vocabulary"),
        ([s], [DraftTree((1, 2), (-1, 1))], "node 1 has parent 1"),
        ([s], [DraftTree((1, 2, 3), (-1, 0))], "one parent per node"),
        ([s, s], [DraftTree.chain([1]), DraftTree.chain([2])], "more than once"),
        ([s], [], "pass one tree per session"),
        ([long], [DraftTree.chain([1, 2])], "exceed the context"),
    ]
    for sessions, trees, needle in bad:
        with pytest.raises(InvalidArgument, match=needle):
            tp_runner.tree_logits_batch(sessions, trees)
    assert not sent and group.state == group.READY and group.restarts == restarts
    tree = DraftTree((4, 5, 6), (-1, 0, -1))
    got = tp_runner.tree_logits_batch([s], [tree])[0]
    with pytest.raises(InvalidArgument, match="not a path"):
        tp_runner.keep_tree_path(s, got, [1])
    assert not tp_runner._kept  # a refused keep is not queued for the followers
    want = tp1_runner.tree_logits_batch([ref], [tree])[0]
    assert _close(got.logits, want.logits) <= TOL
    for runner, session, res in ((tp_runner, s, got), (tp1_runner, ref, want)):
        runner.keep_tree_path(session, res, [0, 1])
        runner.append(session, [7])
    assert _close(tp_runner.logits(s, 1), tp1_runner.logits(ref, 1)) <= TOL
    assert len(sent) == 2 and sent[1][0] == "keep" and group.state == group.READY
    for x in (s, long):
        tp_runner.release(x)


@pytest.fixture(scope="module")
def drafters(tiny_pair: tuple[Path, Path], tp1_runner: CausalLMRunner) -> dict[str, Drafter]:
    vocab = tp1_runner.vocab_size
    return {
        "self": ModelDrafter(CausalLMRunner(load_pretrained(tiny_pair[0]).model)),  # its argmax: paths kept
        "ngram": NgramDrafter(vocab),
        "suffix": SuffixDrafter(vocab),
    }


@pytest.mark.parametrize("kind", ["self", "ngram", "suffix"])
def test_greedy_tree_rounds_on_the_tp_target_spell_target_only(
    tp_runner: TensorParallelRunner, tp1_runner: CausalLMRunner, drafters: dict[str, Drafter], kind: str
) -> None:
    """Each drafter's trees, two requests batched (tree passes of two sessions), give tp=1 target-only's
    tokens (the pair's model draft: through the services below). The n-gram drafter rarely hits the
    random target's argmax; the target as its own draft, and the suffix drafter on its second run (it
    learned the first, tenant "t"), keep paths nearly every round, which the followers keep too."""
    prompts = [[ord(c) for c in text] for text in ("abc abc abc abc", "def f(x):")]  # byte-level ids
    greedy, N = SamplingParams(temperature=0), 12
    want = [
        speculative_generate(p, Verifier(tp1_runner), None, greedy, draft_length=0, max_new_tokens=N).token_ids
        for p in prompts
    ]
    verifier = Verifier(tp_runner)
    for _ in range(2 if kind == "suffix" else 1):
        got = speculative_generate_batch(
            prompts,
            verifier,
            drafters[kind],
            [greedy, greedy],
            draft_lengths=[4, 4],
            max_new_tokens=N,
            tree_budget=8,
            tenant="t",
        )
        assert [r.token_ids for r in got] == want
        assert all(r.stats.accepted_tokens + r.stats.rounds == N for r in got)  # each round: its path + 1
    assert sum(r.stats.draft_tokens for r in got) > 0  # trees reached the target
    if kind in ("self", "suffix"):
        assert sum(r.stats.accepted_tokens for r in got) >= N  # half the tokens came from kept paths


def test_live_ranks_report_one_nth_of_the_sharded_weights(
    tp_runner: TensorParallelRunner, tiny_pair: tuple[Path, Path]
) -> None:
    full = tensor_parallel.shardable_bytes(load_pretrained(tiny_pair[0]).model)
    rank0, _ = tensor_parallel.weight_bytes(tp_runner.model)
    per_rank = [rank0] + [w["sharded_bytes"] for w in tp_runner.group.workers]
    print(f"tiny target, tp={TP}: sharded weight bytes per rank {per_rank} of {full} unsharded")
    assert len(per_rank) == TP
    for b in per_rank:
        assert full / TP <= b <= full / TP * 1.01


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) with a socket listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and local.endswith(f":{port:04X}"):
                out.add(local.rsplit(":", 1)[0])
    return out


def test_the_rendezvous_store_of_local_workers_listens_on_loopback_only(tp_runner: TensorParallelRunner) -> None:
    store = tp_runner.group._store
    assert store is not None
    assert _listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, nothing else


def _verify_request(sid: str, committed: int, drafts: list[int]) -> target_pb2.TargetRequest:
    return target_pb2.TargetRequest(
        request_id=2,
        session_id=sid,
        committed_length=committed,
        verify=target_pb2.Verify(start=committed, draft_token_ids=drafts),
    )


def _greedy_tree(runner: CausalLMRunner, tokens: list[int]) -> DraftTree:
    """3 nodes after `tokens`: a wrong guess, then the target's greedy two tokens (path [1, 2])."""
    s = runner.new_session(tokens)
    first = int(runner.logits(s)[-1].argmax())
    runner.append(s, [first])
    second = int(runner.logits(s)[-1].argmax())
    return DraftTree.from_wire([(first + 1) % runner.vocab_size, first, second], [-1, -1, 1], [], runner.vocab_size)


def test_killed_worker_gives_unavailable_then_the_group_recovers(
    tp_runner: TensorParallelRunner, tp1_runner: CausalLMRunner
) -> None:
    """A chain and a tree verify, a kill, then (restarted) a tree and a chain verify: tp=1's verdicts."""
    group = tp_runner.group
    health: list[bool] = []
    group.on_health = health.append
    verifier = Verifier(tp_runner)
    servicer = TargetServicer(verifier, executor=None, info=common_pb2.ModelInfo())  # type: ignore[arg-type]
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, seed=1)
    verifier.open("s", prompt, params)
    before = verifier.verify(VerifyRequest("s", len(prompt), Proposal([1, 2])))
    tokens = prompt + [1, 2][: before.accepted] + [before.token_id]
    trees = [TreeVerifyRequest("s", len(tokens), _greedy_tree(tp1_runner, tokens), start=len(tokens))]
    kept = verifier.verify_tree(trees[0])
    assert kept.path == (1, 2)  # queued for the followers' next command, which the kill fails
    tokens += [*kept.tokens, kept.token_id]
    restarts, pid = group.restarts, group.workers[0]["pid"]

    os.kill(pid, signal.SIGKILL)
    resp = servicer.handle_batch([_verify_request("s", len(tokens), [3])])[0]
    assert resp.WhichOneof("result") == "error"
    assert resp.error.code == session_pb2.SessionError.CODE_UNAVAILABLE, resp.error
    assert "restarting" in resp.error.message
    with pytest.raises(Unavailable):
        tp_runner.logits(tp_runner.new_session([1, 2]))  # fails fast while the group is down

    _wait(lambda: group.restarts > restarts and group.state == group.READY, RECOVERY_TIMEOUT_S, "the group to restart")
    assert health == [False, True]
    assert group.workers[0]["pid"] != pid
    # The session survived on rank 0; the followers' caches are rebuilt on the next forward (a tree pass).
    trees.append(TreeVerifyRequest("s", len(tokens), _greedy_tree(tp1_runner, tokens), start=len(tokens)))
    again = verifier.verify_tree(trees[1])
    assert again.path == (1, 2)
    n = again.committed_length
    after = verifier.verify(VerifyRequest("s", n, Proposal([3]), start=n))  # as the coordinator sends it: from `start`
    want = Verifier(tp1_runner)
    want.open("s", prompt, params)
    assert want.verify(VerifyRequest("s", len(prompt), Proposal([1, 2]))).token_id == before.token_id
    for got, request in zip((kept, again), trees):
        expect = want.verify_tree(request)
        assert (got.path, got.token_id, got.committed_length) == (expect.path, expect.token_id, expect.committed_length)
    expected = want.verify(VerifyRequest("s", n, Proposal([3]), start=n))
    assert (after.accepted, after.token_id, after.committed_length) == (
        expected.accepted,
        expected.token_id,
        expected.committed_length,
    )
    verifier.close("s")
    want.close("s")
    group.on_health = None


def test_exit_on_worker_failure_hands_over_instead_of_restarting(tp_runner: TensorParallelRunner) -> None:
    """With --exit-on-worker-failure the group calls on_fatal (the server exits, code 3) and does not restart.

    Runs last among the in-process tests: it leaves the group down.
    """
    group = tp_runner.group
    fatal: list[str] = []
    group.exit_on_failure, group.on_fatal = True, fatal.append
    restarts = group.restarts
    os.kill(group.workers[0]["pid"], signal.SIGKILL)
    _wait(lambda: bool(fatal), 30, "on_fatal")
    assert "exited" in fatal[0] or "rank 0" in fatal[0]
    with pytest.raises(Unavailable):
        tp_runner.logits(tp_runner.new_session([1, 2]))
    time.sleep(1.0)
    assert group.restarts == restarts and group.state != group.READY


# ---- the three services, target with --tp 3 (mp) and 2 (ray) ---------------------------------


@pytest.fixture(scope="module")
def tp_target(tiny_models_dir: Path) -> Path:
    """The tiny target that shards by 3 (6 heads over 3 KV heads), with the pair's tokenizer."""
    return build_tiny_target_tp3(tiny_models_dir, seed=0)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[tuple[str, dict[str, str]]]:
    """A local Ray for this module (2 CPUs, 100 MB object store).

    Yields its address and the environment a process needs to join it: Ray
    turns token auth on for the clusters it starts (the token in
    ~/.ray/auth_token), and a joining process must be told the mode.
    """
    ray = pytest.importorskip("ray")
    saved = os.environ.get("RAY_AUTH_MODE")
    context = ray.init(num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False, log_to_driver=False)
    try:
        mode = os.environ.get("RAY_AUTH_MODE")  # set by ray.init when it enabled token auth
        yield context.address_info["gcs_address"], ({"RAY_AUTH_MODE": mode} if mode else {})
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def _tp_args(executor: str, ray_address: str = "") -> list[str]:
    tp = EXECUTOR_TP[executor]
    args = ["--tp", str(tp), "--executor", executor, "--worker-ready-timeout-s", "120", "--metrics-port", "0"]
    return args + (["--ray-address", ray_address] if ray_address else [])


def _model_for(executor: str, tp_target: Path, tiny_pair: tuple[Path, Path]) -> Path:
    return tp_target if EXECUTOR_TP[executor] == 3 else tiny_pair[0]


def _served_model(cluster: Cluster) -> Path:
    """The model folder the cluster's target serves now (tp_cluster may have swapped it)."""
    return Path(cluster.target.args[cluster.target.args.index("--model") + 1])


@pytest.fixture(scope="module")
def services(
    tp_target: Path, tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """coordinator + a tensor-parallel target, started once for both executors, on the session's draft
    (2-core CI: every `specd serve` start costs seconds of imports); `tp_cluster` swaps the target's
    executor (and its model and degree, EXECUTOR_TP)."""
    cache = tmp_path_factory.mktemp("cache")
    model = _model_for("mp", tp_target, tiny_pair)
    cluster = Cluster(model, tiny_pair[1], cache_dir=cache, target_args=_tp_args("mp"), borrow_draft=tiny_cluster)
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        print(cluster.logs())
        raise
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module", params=["mp", "ray"])
def tp_cluster(
    request: pytest.FixtureRequest, services: Cluster, tp_target: Path, tiny_pair: tuple[Path, Path]
) -> Iterator[Cluster]:
    """The services with the target running its tp ranks on `request.param`."""
    address, env = request.getfixturevalue("local_ray") if request.param == "ray" else ("", {})
    args = _tp_args(request.param, address)
    model = _model_for(request.param, tp_target, tiny_pair)
    if services.target.args[-len(args) :] != args or _served_model(services) != model:
        # Restart the target alone on its port with the other executor (and model); the coordinator
        # reconnects and its sessions heal, as after any target restart (same tokenizer and vocabulary).
        old = services.target
        old.stop(grace_s=10.0)
        port = (old.address or ":0").rsplit(":", 1)[1]
        base = old.args[: old.args.index("--tp")]
        base[base.index("--port") + 1] = port
        base[base.index("--model") + 1] = str(model)
        # A fresh QuietService: the stopped one's log relay may still be draining.
        services.target = QuietService("target", base + args)
        services.target.start({**services.env, **env})
        try:
            services.target.wait_ready(READY_TIMEOUT_S)
        except RuntimeError:
            print(services.logs())
            raise
    yield services
    if request.param == "ray":
        services.target.stop(grace_s=10.0)  # before the module's Ray goes away


def _worker_pid(cluster: Cluster) -> int:
    found = re.findall(r"tp worker rank 1 ready: pid (\d+)", "".join(cluster.target.lines))
    assert found, cluster.logs()
    return int(found[-1])


def _health(channel: grpc.Channel) -> int:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    except grpc.RpcError:
        return -1


TREE = dict(speculation="fixed", draft_length=4, tree_budget=8)  # trees of 8 nodes, 4 levels


def test_tp_services_give_tp1_tokens_chains_and_trees(tp_cluster: Cluster, tiny_pair: tuple[Path, Path]) -> None:
    """Eight requests at once, so the tensor-parallel target batches them (forward_batch and tree_batch
    on every rank): chains and trees (plain and pipelined), greedy (target-only's tokens) and seeded (the
    in-process loop's)."""
    target, draft = _served_model(tp_cluster), tiny_pair[1]
    calls = []
    n = 16  # tokens per request (~n rounds: the draft rarely hits); a tp=3 round costs ~2x a tp=2 one on 2 cores
    for k, text in zip([1, 4, 6], PROMPTS):
        ids = _ids(target, text)
        want = reference(target, None, ids, SamplingParams(temperature=0), max_new_tokens=n)
        calls.append((ids, dict(max_new_tokens=n, temperature=0, speculation="fixed", draft_length=k), want))
    for seed, (temperature, top_k, top_p) in enumerate([(0.8, 0, 1.0), (1.2, 20, 0.9)]):
        ids = _ids(target, PROMPTS[seed])
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + 11)
        want = reference(target, draft, ids, params, max_new_tokens=n, draft_length=4)
        calls.append(
            (
                ids,
                dict(
                    max_new_tokens=n,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    seed=seed + 11,
                    speculation="fixed",
                    draft_length=4,
                ),
                want,
            )
        )
    ids = _ids(target, PROMPTS[1])
    want = reference(target, None, ids, SamplingParams(temperature=0), max_new_tokens=12)
    calls.append((ids, dict(max_new_tokens=12, temperature=0, **TREE), want))
    calls.append((ids, dict(max_new_tokens=12, temperature=0, pipeline="bonus-match", **TREE), want))  # pipelined
    ids, params = _ids(target, PROMPTS[3]), SamplingParams(temperature=0.9, top_k=40, seed=7)
    want = reference(target, draft, ids, params, max_new_tokens=n, draft_length=4, tree_budget=8)
    calls.append((ids, dict(max_new_tokens=n, temperature=0.9, top_k=40, seed=7, **TREE), want))

    def run(call):
        ids, kwargs, _ = call
        with tp_cluster.client() as client:
            return client.generate(ids, ignore_eos=True, **kwargs)

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        results = list(pool.map(run, calls))
    for (_, kwargs, want), got in zip(calls, results):
        assert list(got.token_ids) == want.token_ids, tp_cluster.logs()
        assert got.stats.draft_tokens > 0
        if want.stats.drafts:  # an in-process loop with the draft: the same rounds
            assert (got.stats.accepted_tokens, got.stats.draft_tokens) == (
                want.stats.accepted_tokens,
                want.stats.draft_tokens,
            )
        if "tree_budget" in kwargs:
            assert got.stats.draft_tokens > got.stats.drafts  # trees of several nodes went out
    assert results[-1].stats.accepted_tokens > 0  # a path was kept (on every rank) through the services
    assert tp_cluster.target is not None
    # A follower out of step dies and the group restarts, which retries would hide from the tokens.
    assert not any("worker group failed" in line for line in tp_cluster.target.lines), tp_cluster.logs()
    samples = scrape(metrics_address(tp_cluster.target))
    mean_batch = total(samples, "specd:target_batch_size_sum") / total(samples, "specd:target_batch_size_count")
    assert mean_batch > 1.0  # some verifies shared a forward pass: forward_batch ran on both ranks


@pytest.mark.parametrize("tp_cluster", ["ray"], indirect=True)  # mp: the in-process test above
def test_killing_a_worker_fails_rounds_fast_then_the_service_recovers(tp_cluster: Cluster) -> None:
    target = _served_model(tp_cluster)
    pid = _worker_pid(tp_cluster)
    assert tp_cluster.target.address
    with grpc.insecure_channel(tp_cluster.target.address) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
        # A round sent while the group restarts fails at once, in-band UNAVAILABLE (retryable).
        prompt = [72, 105, 33]
        requests = [
            target_pb2.TargetRequest(
                request_id=1,
                session_id="killed",
                committed_length=len(prompt),
                open=target_pb2.TargetOpen(token_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0, seed=1)),
            ),
            _verify_request("killed", len(prompt), [1, 2]),
        ]
        started = time.monotonic()
        responses = list(answers(target_pb2_grpc.TargetStub(channel).Rounds(one_per_message(requests), timeout=30)))
        assert time.monotonic() - started < 10
        assert responses[1].error.code == session_pb2.SessionError.CODE_UNAVAILABLE, responses[1]
        _wait(lambda: _health(channel) == health_pb2.HealthCheckResponse.SERVING, RECOVERY_TIMEOUT_S, "SERVING again")
    # The group logs its new workers before it serves; the line reaches this process through a pipe.
    _wait(lambda: _worker_pid(tp_cluster) != pid, 10, "the restarted worker's ready line")
    ids = _ids(target, PROMPTS[0])
    want = reference(target, None, ids, SamplingParams(temperature=0), max_new_tokens=16)
    with tp_cluster.client() as client:
        got = client.generate(
            ids, max_new_tokens=16, temperature=0, ignore_eos=True, speculation="fixed", draft_length=4
        )
    assert list(got.token_ids) == want.token_ids
