"""Suffix speculation in-process: the index against a brute-force reference, its memory bound, the
drafter's learning across sessions, and exactness (greedy parity, seeded equality) for suffix and hybrid."""

from __future__ import annotations

import random
import threading
import tracemalloc
from pathlib import Path

import pytest

from specd.core.draft.hybrid import HybridDrafter, common_prefix_length
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.suffix import SuffixDrafter, SuffixSettings
from specd.core.draft.suffix_index import Candidate, SharedSuffixIndex, SuffixIndex
from specd.core.errors import InvalidArgument, SessionOutOfSync
from specd.core.inprocess import speculative_generate
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier

GREEDY = SamplingParams(temperature=0.0)
RULES = dict(factor=1.0, offset=0.0, min_prob=0.1)


# ---- the index -----------------------------------------------------------------------


def brute_force(docs: list[list[int]], open_last: bool, ctx: list[int], k: int, anchor: int, depth: int) -> Candidate:
    """The suffix-tree answer by exhaustive search: every match length, every occurrence."""
    best = Candidate()
    for length in range(min(len(ctx), depth), anchor - 1, -1):
        node = [
            (d, p)
            for d, doc in enumerate(docs)
            for p in range(length, len(doc) + (0 if open_last and d == len(docs) - 1 else 1))
            if doc[p - length : p] == ctx[-length:]
        ]
        cap = min(k, int(length * RULES["factor"] + RULES["offset"] + 1e-6))
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        while len(tokens) < cap and node:
            nxt = [docs[d][p + len(tokens)] if p + len(tokens) < len(docs[d]) else None for d, p in node]
            counts: dict[int, int] = {}
            for t in nxt:
                if t is not None:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            top = max(counts.values())
            token = next(t for t in nxt if t is not None and counts[t] == top)  # ties: the earliest occurrence
            prob *= top / len(node)
            if prob < RULES["min_prob"]:
                break
            tokens.append(token)
            probs.append(prob)
            node = [o for o, t in zip(node, nxt) if t == token]
        if sum(probs) > best.score:
            best = Candidate(tokens, probs, sum(probs), length)
    return best


@pytest.mark.parametrize("anchor", [1, 2, 3])
def test_index_answers_like_an_exhaustive_search(anchor: int) -> None:
    rng = random.Random(anchor)
    for trial in range(40):
        vocab = rng.choice([3, 5, 8])
        docs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 5))]
        open_last = trial % 2 == 0
        index = SuffixIndex(anchor=anchor, max_depth=6)
        for doc in docs[:-1] if open_last else docs:
            index.add_document(doc)
        if open_last:
            index.extend(docs[-1])
        index.check()
        for _ in range(10):
            ctx = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
            if open_last and rng.random() < 0.5:
                ctx = docs[-1][-rng.randrange(1, 9) :]  # the open document's own end, as a session asks
            want = brute_force(docs, open_last, ctx, 5, anchor, 6)
            got = index.speculate(ctx, 5, **RULES)
            assert got.token_ids == want.token_ids, (docs, ctx)
            assert got.score == pytest.approx(want.score) and got.probs == pytest.approx(want.probs)


def test_index_rules_most_frequent_capped_and_cut_by_probability() -> None:
    index = SuffixIndex(anchor=1, max_depth=24)
    for tail in ([7, 8], [7, 8], [7, 9], [5, 6]):
        index.add_document([1, 2, 3, *tail])
    c = index.speculate([1, 2, 3], 8, **RULES)
    assert c.token_ids == [7, 8] and c.probs == pytest.approx([0.75, 0.5]) and c.match_len == 3
    assert index.speculate([3], 8, **RULES).token_ids == [7]  # match length 1: at most 1 token (factor 1)
    assert index.speculate([1, 2, 3], 8, factor=1.0, offset=0.0, min_prob=0.6).token_ids == [7]
    assert index.speculate([2, 3], 8, factor=2.0, offset=0.0, min_prob=0.1).token_ids == [7, 8]
    assert index.speculate([4, 4], 8, **RULES).token_ids == []  # never seen
    assert index.speculate([1, 2, 3], 0, **RULES).token_ids == []
    index.add_document([1, 2])  # a document ends: its end counts in the node, so the first step is 3/5
    assert index.speculate([1, 2], 2, **RULES).probs == pytest.approx([0.8, 0.6])


def test_open_document_truncates_and_extends_consistently() -> None:
    index = SuffixIndex(anchor=2, max_depth=8)
    index.add_document([1, 2, 3, 4])
    index.extend([9, 1, 2, 3, 5, 1, 2])
    assert index.speculate([1, 2], 4, **RULES).token_ids == [3, 4]  # then 4 or 5 (1/2 each): the earliest
    index.truncate(3)  # back to [9, 1, 2]: the occurrence followed by 5 is gone
    index.check()
    assert index.open_length() == 3 and index.postings_of([3, 5]) == []
    index.extend([3, 6])
    index.check()
    with pytest.raises(InvalidArgument):
        index.truncate(99)
    index.add_document([7])  # closes the open document
    index.check()
    assert index.documents == 3


def test_global_index_stays_within_its_budget_after_ten_thousand_requests() -> None:
    budget = 256 << 10
    index = SharedSuffixIndex(budget, anchor=2)
    rng = random.Random(0)
    template = [rng.randrange(1000) for _ in range(60)]
    for r in range(10_000):
        doc = list(template)
        for _ in range(8):  # each request repeats the structure with its own values
            doc[rng.randrange(len(doc))] = rng.randrange(1000)
        doc += [rng.randrange(50_000) for _ in range(rng.randrange(0, 40))]
        index.add(doc)
        assert index.nbytes <= budget, f"request {r}: {index.nbytes} bytes > budget {budget}"
        if r in (0, 5000):
            index.check()
    index.check()
    assert index.evicted_documents > 0 and index.documents > 20  # full, and full of recent requests
    assert index.added_documents == 10_000
    index.add(template + [1, 2, 3])  # the newest is kept, and matched
    assert index.speculate(template[-4:] + [1, 2], 4, **RULES).token_ids == [3]


def test_oldest_documents_are_evicted_first() -> None:
    index = SharedSuffixIndex(64 << 10, anchor=2)
    for r in range(2000):
        index.add([r % 1000, 1000 + r // 1000, 5000 + r, 7, 7])
    assert index.speculate([1999 % 1000, 1001], 1, **RULES).token_ids == [5000 + 1999]  # newest: kept
    assert index.speculate([0, 1000], 1, **RULES).token_ids == []  # oldest: evicted
    index.check()


def test_index_bytes_are_the_memory_it_holds() -> None:
    """nbytes is counted from the live objects; tracemalloc sees about as much."""
    rng = random.Random(1)
    docs = [[rng.randrange(3000) for _ in range(200)] for _ in range(50)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = SuffixIndex(anchor=2)
        for doc in docs:
            index.add_document(doc)
        index.compact()
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.8 * traced <= index.nbytes <= 1.25 * traced, (index.nbytes, traced)


def test_global_index_is_thread_safe() -> None:
    index = SharedSuffixIndex(128 << 10, anchor=2)
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                index.add([rng.randrange(200) for _ in range(rng.randrange(1, 80))])
        except BaseException as exc:  # reported below
            errors.append(exc)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1500):
                c = index.speculate([rng.randrange(200) for _ in range(6)], 8, **RULES)
                assert len(c) <= 8 and index.nbytes >= 0
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=f, args=(i,)) for i, f in enumerate([writer, writer, reader, reader])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert index.nbytes <= index.max_bytes and index.added_documents == 600
    index.check()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        SuffixIndex(anchor=4)
    with pytest.raises(InvalidArgument):
        SuffixIndex(anchor=2).add_document([-3])
    for bad in (dict(min_token_prob=1.5), dict(fallback="model"), dict(max_spec_factor=0.0), dict(max_depth=1)):
        with pytest.raises(InvalidArgument):
            SuffixDrafter(100, SuffixSettings(**bad))  # type: ignore[arg-type]


# ---- the drafter -----------------------------------------------------------------------


def test_drafter_learns_finished_sessions_and_their_prompt_tails() -> None:
    drafter = SuffixDrafter(100, SuffixSettings(fallback="none"))
    prompt, answer = [1, 2, 3, 4], [10, 11, 12, 13, 14, 15]
    drafter.open("a", prompt, GREEDY, tenant="t")
    assert drafter.propose(ProposeRequest("a", 4, 4, [], 4)).token_ids == []  # nothing seen yet
    drafter.propose(
        ProposeRequest("a", 10, 4, answer, 4)
    )  # the service learns the committed answer from propose messages
    drafter.close("a")
    assert drafter.learned.documents == 1
    drafter.open("b", [9, 9, 3, 4], GREEDY, tenant="t")  # another request ending like a's prompt
    assert drafter.propose(ProposeRequest("b", 4, 4, [], 4)).token_ids == [10, 11]  # a 2-token match proposes at most 2
    # both accepted, then the target's 12: the 5-token match (3 4 10 11 12) proposes up to the stored end
    assert drafter.propose(ProposeRequest("b", 7, 6, [12], 8)).token_ids == [13, 14, 15]
    assert drafter.proposals_by_source["global"] >= 2


def test_finish_teaches_the_tokens_no_propose_carried() -> None:
    drafter = SuffixDrafter(100, SuffixSettings(fallback="none"))
    drafter.open("a", [1, 2, 3], GREEDY, tenant="t")
    drafter.propose(ProposeRequest("a", 4, 3, [10], 2))  # the last propose saw 1 2 3 10 ...
    drafter.finish("a", 9, 4, [11, 12, 13, 14, 15])  # ... the close says the answer went on
    drafter.close("a")
    drafter.open("b", [7, 2, 3], GREEDY, tenant="t")
    assert drafter.propose(ProposeRequest("b", 5, 3, [10, 11], 8)).token_ids == [
        12,
        13,
        14,
        15,
    ]  # match 2 3 10 11: up to 4
    drafter.finish("missing", 3, 0, [1, 2, 3])  # unknown session: nothing to learn, no error
    drafter.finish("b", 3, 99, [])  # out of step: keeps what it holds
    drafter.close("b")
    assert drafter.learned.documents == 2


def test_drafter_follows_rollbacks_and_accepted_drafts() -> None:
    drafter = SuffixDrafter(100, SuffixSettings(fallback="none"))
    drafter.open("s", [5, 6, 7, 5, 6, 7, 5, 6], GREEDY, tenant="t")
    first = drafter.propose(ProposeRequest("s", 8, 8, [], 4))
    assert first.token_ids == [7, 5, 6]  # the match (length 5) is followed by what is known: up to the end
    # two accepted, then the target's own token: start counts the drafts the draft already holds
    assert drafter.propose(ProposeRequest("s", 11, 10, [9], 4)).token_ids == []
    with pytest.raises(SessionOutOfSync):
        drafter.propose(ProposeRequest("s", 12, 99, [], 4))
    drafter.propose(
        ProposeRequest("s", 12, 10, [9, 9], 2)
    )  # a prefix that changed inside the drafts: cut back, re-indexed
    drafter.close("s")
    assert drafter.learned.documents == 1


def test_fallback_proposes_the_ngram_lookup_when_the_indexes_have_nothing() -> None:
    # 1 2 is followed by 3, 4, 5 and 6 once each: no continuation reaches min_token_prob 0.3
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2]
    settings = SuffixSettings(min_token_prob=0.3)
    with_fallback = SuffixDrafter(10, settings)
    with_fallback.open("s", prompt, GREEDY)
    assert with_fallback.propose(ProposeRequest("s", len(prompt), len(prompt), [], 4)).token_ids == [
        3,
        1,
    ]  # the earliest, capped
    assert with_fallback.proposals_by_source["ngram"] == 1
    without = SuffixDrafter(10, SuffixSettings(min_token_prob=0.3, fallback="none"))
    without.open("s", prompt, GREEDY)
    assert without.propose(ProposeRequest("s", len(prompt), len(prompt), [], 4)).token_ids == []


def test_a_proposal_says_how_sure_each_token_is() -> None:
    """Each token's confidence is its continuation frequency given the tokens before it (auto cuts by it)."""
    drafter = SuffixDrafter(100, SuffixSettings(fallback="none"))
    drafter.open("sure", [5, 6, 7, 5, 6, 7, 5, 6], GREEDY)
    sure = drafter.propose(ProposeRequest("sure", 8, 8, [], 4))
    assert sure.token_ids == [7, 5, 6] and sure.confidence == (1.0, 1.0, 1.0)  # one way on, every time
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2]
    drafter.open("fork", prompt, GREEDY)
    fork = drafter.propose(ProposeRequest("fork", len(prompt), len(prompt), [], 6))
    assert len(fork.confidence) == len(fork.token_ids) == 6
    assert all(0.0 < c <= 1.0 for c in fork.confidence) and min(fork.confidence) < 1.0  # 3 went on two ways
    ngram = SuffixDrafter(10, SuffixSettings(min_token_prob=0.3))
    spread = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 6, 1, 2]
    ngram.open("s", spread, GREEDY)
    fallback = ngram.propose(ProposeRequest("s", len(spread), len(spread), [], 4))
    # the n-gram fallback scores its match: L / (L + 1) for an agreeing context of L tokens (here "1 2")
    assert fallback.token_ids and fallback.confidence == (2 / 3,) * len(fallback.token_ids)


def test_idle_sessions_are_learnt_when_they_expire() -> None:
    drafter = SuffixDrafter(100, idle_timeout_s=1e-9)
    drafter.open("old", [1, 2], GREEDY, tenant="t")
    drafter.propose(ProposeRequest("old", 5, 2, [3, 4, 5], 1))
    drafter.open("new", [1, 2], GREEDY, tenant="t")  # admitting a session expires the idle one
    assert drafter.active_sessions() == 1 and drafter.learned.documents == 1


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_length([], [1]) == 0
    a = list(range(1000))
    b = a[:617] + [-1] + a[618:]
    assert common_prefix_length(a, b) == 617


# ---- exactness with real (tiny) models ------------------------------------------------------

REPEATING = ["abc abc abc abc", "the cat sat on the mat. the cat", "def f(x):\n    return x\n\ndef f(x):"]


@pytest.fixture(scope="module")
def tiny(tiny_pair: tuple[Path, Path]):
    target, draft = tiny_pair
    t, d = load_pretrained(target), load_pretrained(draft)
    return t, Verifier(CausalLMRunner(t.model)), CausalLMRunner(d.model), CausalLMRunner(t.model)


def _sequence(loaded, verifier, drafter, params_for, k: int, n: int = 24) -> list[list[int]]:
    """The requests of REPEATING twice, in sequence through one drafter (the second pass can use the first)."""
    out = []
    for i, text in enumerate(REPEATING * 2):
        ids = loaded.tokenizer(text).input_ids
        got = speculative_generate(
            ids, verifier, drafter, params_for(i), draft_length=k, max_new_tokens=n, session_id=f"r{i}"
        )
        out.append(got)
    return out


@pytest.mark.parametrize("k", [2, 8])
def test_suffix_and_hybrid_greedy_equal_target_only(tiny, k: int) -> None:
    loaded, verifier, draft_runner, self_runner = tiny
    ref = [r.token_ids for r in _sequence(loaded, verifier, None, lambda i: GREEDY, 0)]
    drafters = {
        "suffix": SuffixDrafter(verifier.vocab_size),
        "hybrid": HybridDrafter(ModelDrafter(draft_runner), threshold=1.0),
        "hybrid, target as its draft": HybridDrafter(ModelDrafter(self_runner), threshold=2.0),
    }
    for name, drafter in drafters.items():
        got = _sequence(loaded, verifier, drafter, lambda i: GREEDY, k)
        assert [r.token_ids for r in got] == ref, name
        assert sum(r.stats.draft_tokens for r in got) > 0, name  # it did draft: not parity by default
    hybrid = drafters["hybrid, target as its draft"]
    assert hybrid.stats.proposals["suffix"] > 0 and hybrid.stats.proposals["model"] > 0


def test_suffix_and_hybrid_seeded_sampling_is_reproducible(tiny) -> None:
    """Same seeds, same sequence of requests, a fresh drafter: the same tokens (the drafts depend on tokens only)."""
    loaded, verifier, draft_runner, _ = tiny

    def params(i: int) -> SamplingParams:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i)

    for make in (
        lambda: SuffixDrafter(verifier.vocab_size),
        lambda: HybridDrafter(ModelDrafter(draft_runner), threshold=1.0, adaptive_k=False),
    ):
        a = _sequence(loaded, verifier, make(), params, 4)
        b = _sequence(loaded, verifier, make(), params, 4)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        assert [r.stats.accepted_tokens for r in a] == [r.stats.accepted_tokens for r in b]
        assert sum(r.stats.draft_tokens for r in a) > 0
