"""Exactness on the emulated accelerator: sampled outputs against the emulator's own p (one-sample).

Every pipeline strategy (off, bonus-match, post-verify, spec-cache), and tree rounds plain and
pipelined (docs/trees.md), runs the round loop
with an emulated target and draft (`sim:...`) two ways: in-process (the
coordinator's own RoundLoop over local ports, specd.core.inprocess) for all
REQUESTS of a cell, and through the three services as processes for the
first SERVICE_REQUESTS of them. The services must emit exactly the
in-process tokens, request for request (seeded coins depend only on seed,
position and role), so the statistics below hold for what they emit; the
in-process run gives the full sample cheaply (no gRPC between processes).
Because p is a known function of
the context (specd.core.model.sim), every emitted token can be scored against the
target's processed distribution *for its own context*: its rank under that
p falls in a bucket, and the bucket counts over all emitted tokens must fit
the bucket probabilities summed over the same tokens (Pearson chi-square,
one sample: expected counts come from p itself, not from a second run).
Sequential dependence does not matter: each token's bucket has a known
conditional distribution given everything before it.

Greedy (T = 0) must be token-for-token the argmax chain of p, computed here
from the function directly.

Power: the same tokens scored against p at a wrong temperature, and tokens
sampled from the draft's q, must be rejected.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from scipy import stats

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.inprocess import speculative_generate_batch
from specd.core.model.sim import SimLM, parse_sim_spec
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from tests.cluster import Cluster

pytestmark = pytest.mark.slow

# Small vocabulary (cheap host-side sampling), the 70B profile's shape, sped up 10x; a good draft
# (agreement 0.8) so that every strategy accepts often and pipelining hits.
SPEC = "sim:h100-tp2-70b,vocab_size=2048,time_scale=0.1,agreement=0.8"
# The served target runs at three times the profile's time, thirty times the draft's: a pipelined round's
# pre-drafts land while it is still verified and are staged at the target (its staged verifies
# are then part of every pipelined cell through the services). Timing changes no token.
TARGET_SPEC = SPEC.replace("time_scale=0.1", "time_scale=3")
STAGING = ("bonus-match", "post-verify", "spec-cache")  # the strategies whose pre-drafts are staged
REQUESTS = 64
# Of them through the services (one wave of the 8 clients), token for token against the in-process run.
SERVICE_REQUESTS = 8
NEW_TOKENS = 32
BUCKETS = [(0, 1), (1, 2), (2, 3), (3, 5), (5, 10), (10, 30), (30, None)]  # rank ranges [lo, hi)
PASS_P = 1e-3
FAIL_P = 1e-6
STRATEGIES = ["off", "bonus-match", "post-verify", "spec-cache"]
TREE_STRATEGIES = ["off", "bonus-match"]  # what tree rounds pipeline with
TREE_BUDGET = 8  # nodes of a tree, 4 levels deep
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_k": 20},
    {"temperature": 1.0, "top_p": 0.8},
]


def processed(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """[R, V] logits -> [R, V] float64 probabilities: temperature, softmax, top-k, top-p (independent of specd.core.sampling.sampler)."""
    z = logits.astype(np.float64) / temperature
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    if not 0 < top_k < p.shape[1] and top_p >= 1.0:
        return p  # nothing to cut: the sort below would keep every token
    order = np.argsort(-p, axis=1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=1)
    keep = np.ones_like(sorted_p, dtype=bool)
    if 0 < top_k < p.shape[1]:
        keep[:, top_k:] = False
    if top_p < 1.0:
        renorm = sorted_p * keep
        renorm /= renorm.sum(axis=1, keepdims=True)
        before = np.cumsum(renorm, axis=1) - renorm
        keep &= before < top_p
    mask = np.zeros_like(keep)
    np.put_along_axis(mask, order, keep, axis=1)
    p = p * mask
    return p / p.sum(axis=1, keepdims=True)


def chi2_of_ranks(probs: np.ndarray, tokens: np.ndarray) -> float:
    """p-value of the emitted tokens' rank buckets against the buckets' probabilities (summed over rows).

    A token's rank is its place in its row sorted by falling probability, ties in index order (a
    stable sort's), counted without sorting the rows; only the top ranks the buckets name are sorted.
    """
    rows = np.arange(len(tokens))
    chosen = probs[rows, tokens][:, None]
    if (chosen == 0).any():
        return 0.0  # a token p forbids: outright failure
    before = np.arange(probs.shape[1])[None, :] < tokens[:, None]
    ranks = (probs > chosen).sum(axis=1) + ((probs == chosen) & before).sum(axis=1)
    top = max(lo for lo, _ in BUCKETS)  # ranks [top, V) form the last bucket: the rest of each row's mass
    head = np.sort(np.partition(-probs, top - 1, axis=1)[:, :top], axis=1)  # -(the top probabilities), sorted
    sorted_top = -head
    observed, expected = [], []
    for lo, hi in BUCKETS:
        observed.append(float(((ranks >= lo) & (ranks < (probs.shape[1] if hi is None else hi))).sum()))
        mass = sorted_top[:, lo:hi].sum() if hi is not None else probs.sum() - sorted_top.sum()
        expected.append(float(mass))
    obs, exp = np.array(observed), np.array(expected)
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    # Pool sparse buckets into their neighbour (expected >= 5).
    while len(exp) > 2 and exp.min() < 5:
        i = int(exp.argmin())
        j = i - 1 if i == len(exp) - 1 else i + 1
        obs[j] += obs[i]
        exp[j] += exp[i]
        obs, exp = np.delete(obs, i), np.delete(exp, i)
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def rows_and_tokens(prompts: list[list[int]], outputs: list[list[int]]) -> tuple[list[list[int]], np.ndarray]:
    """Every emitted token with its context (prompt + the tokens before it)."""
    contexts, tokens = [], []
    for prompt, out in zip(prompts, outputs):
        for i, t in enumerate(out):
            contexts.append(prompt + out[:i])
            tokens.append(t)
    return contexts, np.array(tokens, dtype=np.int64)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # A draft that times out makes its round target-only: exact, but other tokens than the in-process
    # run's. A slow round on a busy machine is not what this module is about (test_faults is).
    args = ["--draft-timeout-s", "60"]
    with Cluster(TARGET_SPEC, SPEC, cache_dir=tmp_path_factory.mktemp("sim-cache"), coordinator_args=args) as c:
        yield c


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 12))] for _ in range(REQUESTS)]


def run(
    cluster: Cluster,
    prompts: list[list[int]],
    strategy: str,
    speculation: str = "fixed",
    tree_budget: int = 0,
    **sampling,
) -> tuple[list[list[int]], list]:
    def one(i: int):
        with cluster.client() as client:
            return client.generate(
                prompts[i],
                max_new_tokens=NEW_TOKENS,
                seed=1000 + i,
                speculation=speculation,
                draft_length=4,
                pipeline=strategy,
                tree_budget=tree_budget,
                **sampling,
            )

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(len(prompts))))
    return [list(r.token_ids) for r in responses], [r.stats for r in responses]


def run_in_process(
    prompts: list[list[int]], strategy: str, tree_budget: int = 0, **sampling
) -> tuple[list[list[int]], list]:
    """The same requests through the coordinator's round loop in this process (fresh emulated runners)."""
    profile = parse_sim_spec(SPEC)
    params = [SamplingParams(seed=1000 + i, **sampling) for i in range(len(prompts))]
    results = speculative_generate_batch(
        prompts,
        Verifier(profile.runner("target")),
        ModelDrafter(profile.runner("draft")),
        params,
        draft_lengths=[4] * len(prompts),
        max_new_tokens=NEW_TOKENS,
        pipeline=strategy,
        tree_budget=tree_budget,
    )
    return [r.token_ids for r in results], [r.stats for r in results]


def check_speculation(outputs: list[list[int]], st: list, strategy: str, accepted: float = 0.3) -> None:
    """accepted: the share of draft tokens (a tree's: its nodes) accepted that shows speculation really ran."""
    assert all(len(o) == NEW_TOKENS for o in outputs)
    assert sum(s.accepted_tokens for s in st) > accepted * sum(s.draft_tokens for s in st)
    if strategy != "off":
        assert sum(s.pipeline_hits for s in st) > 0, "the pipeline strategy never hit: it was not exercised"
    if strategy == "spec-cache":  # both kinds of branch were used, not only the all-accepted one
        outcomes = {o for s in st for o in s.pipeline_hits_by_outcome}
        assert "4:bonus" in outcomes and any(o.endswith(":recovered") for o in outcomes), outcomes


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_emitted_tokens_follow_the_emulators_p(cluster, prompts, strategy, setting):
    outputs, st = run_in_process(prompts, strategy, **setting)
    check_speculation(outputs, st, strategy)
    served, served_st = run(cluster, prompts[:SERVICE_REQUESTS], strategy, **setting)
    check_speculation(served, served_st, strategy)
    if strategy in STAGING:  # the target verified staged pre-drafts by itself: those tokens are in the sample
        assert sum(s.staged_rounds for s in served_st) > 0, "no round was staged: staging was not exercised"
    for i, (got, s) in enumerate(zip(served, served_st)):
        assert got == outputs[i], f"request {i}: the services emitted other tokens than the in-process loop ({s})"
    check_p(prompts, outputs, setting, strategy)  # power: the same test rejects these tokens at 1.3x T


# Pipelined trees in every setting; plain sampled trees at T = 1 (tests/slow/test_tree_stats.py has their
# joint cells, top-k and top-p among them).
TREE_CELLS = [("bonus-match", setting) for setting in SETTINGS] + [("off", SETTINGS[0])]


@pytest.mark.parametrize(
    "strategy, setting",
    TREE_CELLS,
    ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()),
)
def test_tree_rounds_follow_the_emulators_p(cluster, prompts, strategy, setting):
    """Sampled trees (docs/trees.md), plain and pipelined: a pipelined hit verifies the pre-draft's subtree
    under the target's own token, chosen by that token; the tokens still follow p, in-process and through
    the services alike."""
    outputs, st = run_in_process(prompts, strategy, TREE_BUDGET, **setting)
    check_speculation(outputs, st, strategy, accepted=0.15)  # a path of <= 4 of 8 nodes
    served, served_st = run(cluster, prompts[:SERVICE_REQUESTS], strategy, tree_budget=TREE_BUDGET, **setting)
    for i, (got, s) in enumerate(zip(served, served_st)):
        assert got == outputs[i], f"request {i}: the services emitted other tokens than the in-process loop ({s})"
    check_p(prompts, outputs, setting, f"tree {strategy}")


def check_p(prompts: list[list[int]], outputs: list[list[int]], setting: dict, what: str) -> None:
    """Chi-square of the emitted tokens' ranks against the emulator's p, and its power at 1.3 T."""
    profile = parse_sim_spec(SPEC)
    contexts, tokens = rows_and_tokens(prompts, outputs)
    logits = SimLM(profile.shape).logits(contexts).numpy()
    top_k, top_p = setting.get("top_k", 0), setting.get("top_p", 1.0)
    pvalue = chi2_of_ranks(processed(logits, setting["temperature"], top_k, top_p), tokens)
    assert pvalue > PASS_P, f"{what} {setting}: chi-square p = {pvalue:.2e} over {len(tokens)} tokens"
    wrong = chi2_of_ranks(processed(logits, 1.3 * setting["temperature"], top_k, top_p), tokens)
    assert wrong < FAIL_P, f"the test cannot tell T from 1.3 T (p = {wrong:.2e})"


@pytest.mark.parametrize("setting", SETTINGS[:2], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_auto_through_the_services_follows_p(cluster, prompts, setting):
    """Speculation and pipeline auto: K and the strategy change from round to round with the measured
    costs, so the tokens are not the in-process run's, token for token; their distribution is p's."""
    outputs, st = run(cluster, prompts, "auto", speculation="auto", **setting)
    assert all(len(o) == NEW_TOKENS for o in outputs)
    assert sum(s.accepted_tokens for s in st) > 0.3 * sum(s.draft_tokens for s in st) > 0  # speculation ran
    check_p(prompts, outputs, setting, "auto")


@pytest.mark.parametrize("strategy", [*STRATEGIES, "auto"])
def test_greedy_is_the_argmax_chain_of_p(cluster, prompts, strategy):
    some = prompts[:16]
    speculation = "auto" if strategy == "auto" else "fixed"
    outputs, st = run(cluster, some, strategy, speculation=speculation, temperature=0.0)
    assert sum(s.accepted_tokens for s in st) > 0
    if strategy == "spec-cache":
        outcomes = {o for s in st for o in s.pipeline_hits_by_outcome}
        assert "4:bonus" in outcomes and any(o.endswith(":recovered") for o in outcomes), outcomes
    lm = SimLM(parse_sim_spec(SPEC).shape)
    for prompt, out in zip(some, outputs):
        chain: list[int] = []
        for _ in range(NEW_TOKENS):
            chain.append(int(lm.logits([prompt + chain])[0].argmax()))
        assert out == chain


@pytest.mark.parametrize("strategy", TREE_STRATEGIES)
def test_greedy_trees_are_the_argmax_chain_of_p(cluster, prompts, strategy):
    some = prompts[:16]
    outputs, st = run(cluster, some, strategy, tree_budget=TREE_BUDGET, temperature=0.0)
    assert sum(s.accepted_tokens for s in st) > 0
    if strategy != "off":
        assert sum(s.pipeline_hits for s in st) > 0, "the pipelined trees never hit: it was not exercised"
    lm = SimLM(parse_sim_spec(SPEC).shape)
    for prompt, out in zip(some, outputs):
        chain: list[int] = []
        for _ in range(NEW_TOKENS):
            chain.append(int(lm.logits([prompt + chain])[0].argmax()))
        assert out == chain


def test_the_draft_distribution_is_rejected():
    """Tokens sampled from the draft's q (agreement 0.8) fail the same test against p: it has power."""
    profile = parse_sim_spec(SPEC)
    rng = random.Random(12)
    contexts = [[rng.randrange(256) for _ in range(6)] for _ in range(REQUESTS * NEW_TOKENS)]
    p_logits = SimLM(profile.shape).logits(contexts).numpy()
    q = processed(SimLM(profile.shape, profile.agreement).logits(contexts).numpy(), 1.0)
    gen = torch.Generator().manual_seed(0)
    from_q = torch.multinomial(torch.from_numpy(q), 1, generator=gen)[:, 0].numpy()
    from_p = torch.multinomial(torch.from_numpy(processed(p_logits, 1.0)), 1, generator=gen)[:, 0].numpy()
    assert chi2_of_ranks(processed(p_logits, 1.0), from_p) > PASS_P
    assert chi2_of_ranks(processed(p_logits, 1.0), from_q) < FAIL_P
