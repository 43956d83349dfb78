"""Statistical exactness of suffix and hybrid drafting (ARCHITECTURE.md §3), in the style of test_sampling_stats.

B seeded rows, each its own session of the real SuffixDrafter / HybridDrafter,
generate 3 tokens after a 1-token prompt through the real rejection sampler;
the target is a fixed table from prefix to logits. The global index is fed
sequences first, so the suffix proposes often and is often wrong; the
hybrid's model source is a table draft that samples from exactly the q it
sends. The joint distribution of the 3 tokens must be the target's
(chi-square, p > 0.001), and a hybrid that sends the model's q with a suffix
proposal (a source-mixing bug) must be caught (p < 1e-6).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest
import torch

from specd.core.draft.hybrid import HybridDrafter
from specd.core.draft.suffix import SuffixDrafter, SuffixSettings
from specd.core.rounds.steps import ProposeRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.rejection import SparseProposal, rejection_sample
from specd.core.sampling.sampler import SamplingParams, draft_token, processed_probs
from tests.slow.test_sampling_stats import D_TABLE, MAXLEN, PASS_P, T_TABLE, V3, chi2_pvalue, model_logits

pytestmark = pytest.mark.slow

B = 8_000
PROMPT = [3]  # the tables cover prefixes of up to 6 tokens: 1 + 2 committed + K = 3 drafts
K = 3
I64 = torch.int64
SETTINGS = SuffixSettings(min_token_prob=0.05, fallback="ngram")
TENANT = "stats"  # every row one tenant: the seeded index drafts for all of them


def _probs_batch(table: torch.Tensor, seqs: Sequence[Sequence[int]], params: SamplingParams) -> torch.Tensor:
    """[N, V] processed probabilities after each prefix (each shorter than MAXLEN)."""
    s = torch.tensor([[*seq, *[0] * (MAXLEN - len(seq))] for seq in seqs], dtype=I64).reshape(len(seqs), MAXLEN)
    logits = model_logits(table, s, torch.tensor([len(q) for q in seqs], dtype=I64))  # [N, V]
    return processed_probs(logits[None], [params])[0]  # rows share settings: one call as [1, N, V]


def _probs(table: torch.Tensor, seq: Sequence[int], params: SamplingParams) -> torch.Tensor:
    return _probs_batch(table, [seq], params)[0]


class TableDrafter:
    """A model draft over D_TABLE: samples each token from exactly the q it sends (the Drafter protocol)."""

    kind = "model"
    vocab_size = V3

    def __init__(self) -> None:
        self.sessions: dict[str, tuple[list[int], SamplingParams]] = {}

    def open(
        self,
        session_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        wire_top_k: int = 0,
        tenant: str = "",
        confidence: bool = True,
    ) -> None:
        self.sessions[session_id] = (list(token_ids), params)

    def close(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def active_sessions(self) -> int:
        return len(self.sessions)

    def propose_batch(self, requests: Sequence[ProposeRequest]) -> list[Proposal | Exception]:
        """Every request's drafts, one position at a time across the batch (as the model drafter batches).

        Each row's q comes from its own prefix and its coin from its own (seed, position), so a
        row's tokens do not depend on its batch-mates: the same as drafting the rows one by one.
        """
        seqs = [self.sessions[r.session_id][0][: r.start] + list(r.tail) for r in requests]
        params = [self.sessions[r.session_id][1] for r in requests]
        drafted: list[list[int]] = [[] for _ in requests]
        ids: list[list[torch.Tensor]] = [[] for _ in requests]
        wires: list[list[torch.Tensor]] = [[] for _ in requests]
        for step in range(max((r.num_tokens for r in requests), default=0)):
            groups: dict[tuple, list[int]] = {}  # rows with the same settings (seeds aside) share one call
            for b, r in enumerate(requests):
                if r.num_tokens > step:
                    p = params[b]
                    groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(b)
            for rows in groups.values():
                q = _probs_batch(D_TABLE, [seqs[b] for b in rows], params[rows[0]])  # [n, V]
                seeds = torch.tensor([params[b].seed for b in rows], dtype=I64)
                positions = torch.tensor([len(seqs[b]) for b in rows], dtype=I64)
                tok, i, w = draft_token(q, V3, 16, seeds, positions)
                for n, b in enumerate(rows):
                    drafted[b].append(int(tok[n]))
                    ids[b].append(i[n])
                    wires[b].append(w[n])
                    seqs[b].append(int(tok[n]))
        out: list[Proposal | Exception] = []
        for b, r in enumerate(requests):
            self.sessions[r.session_id] = (seqs[b], params[b])
            out.append(Proposal(drafted[b], torch.stack(ids[b]), torch.stack(wires[b])))
        return out


def _seed_index(drafter: SuffixDrafter | HybridDrafter) -> None:
    """Earlier 'requests': sequences that often, not always, continue the prompt the target's way."""
    rng = random.Random(5)
    for i in range(40):
        drafter.learned.learn(
            TENANT, PROMPT + [rng.randrange(V3) for _ in range(6)] if i % 3 else PROMPT + [2, 2, 0, 4, 1]
        )


def generate3(drafter, params: SamplingParams, seeds: list[int], *, mislabel_q: bool = False) -> torch.Tensor:
    """3 tokens per row after PROMPT; rows run round by round, each its own session. Returns [B, 3]."""
    n = len(seeds)
    committed = [list(PROMPT) for _ in range(n)]
    known = [len(PROMPT)] * n
    for i in range(n):
        params_i = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seeds[i])
        drafter.open(f"r{i}", PROMPT, params_i, tenant=TENANT)
    while live := [i for i in range(n) if len(committed[i]) < len(PROMPT) + 3]:
        proposals = drafter.propose_batch(
            [ProposeRequest(f"r{i}", len(committed[i]), known[i], committed[i][known[i] :], K) for i in live]
        )
        m = len(live)
        drafts = torch.zeros(m, K, dtype=I64)
        num = torch.zeros(m, dtype=I64)
        q_ids = torch.zeros(m, K, V3, dtype=I64)
        q_probs = torch.zeros(m, K, V3, dtype=torch.float32)
        prefixes: list[list[int]] = []
        mislabelled: list[tuple[int, int, list[int]]] = []  # (row, position, prefix) given the model's q
        for row, (i, prop) in enumerate(zip(live, proposals)):
            assert isinstance(prop, Proposal)
            toks = prop.token_ids[:K]
            num[row] = len(toks)
            drafts[row, : len(toks)] = torch.tensor(toks, dtype=I64)
            for j, t in enumerate(toks):
                if prop.q_ids is not None:  # the model source: its sparse q
                    q_ids[row, j, : prop.q_ids.shape[1]] = prop.q_ids[j]
                    q_probs[row, j, : prop.q_probs.shape[1]] = prop.q_probs[j]
                elif mislabel_q:  # BUG under test: a suffix token sent with the model's q at that position
                    mislabelled.append((row, j, committed[i] + toks[:j]))
                else:  # one-hot (what a suffix proposal means)
                    q_ids[row, j, 0], q_probs[row, j, 0] = t, 1.0
            prefixes += [(committed[i] + toks)[: len(committed[i]) + j] for j in range(K + 1)]
        if mislabelled:  # the model's q after each prefix (rows never mix: one batched call)
            qs = _probs_batch(D_TABLE, [prefix for _, _, prefix in mislabelled], params)
            for (row, j, _), q in zip(mislabelled, qs):
                q_ids[row, j] = torch.arange(V3)
                q_probs[row, j] = torch.where(q > 0, q, torch.full_like(q, 1e-3))
        p = _probs_batch(T_TABLE, prefixes, params).reshape(m, K + 1, V3)  # [m, K+1, V]
        start = torch.tensor([len(committed[i]) for i in live], dtype=I64)
        v = rejection_sample(
            p, drafts, SparseProposal(q_ids, q_probs), torch.tensor([seeds[i] for i in live]), start, num
        )
        for row, i in enumerate(live):
            a = int(v.num_accepted[row])
            if int(num[row]) > 0:
                known[i] = len(committed[i]) + a
            committed[i] += drafts[row, :a].tolist() + [int(v.next_token[row])]
    for i in range(n):
        drafter.close(f"r{i}")
    return torch.tensor([c[len(PROMPT) : len(PROMPT) + 3] for c in committed], dtype=I64)


def exact_joint(params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) under target-only sampling. [V^3] float64."""
    out = torch.zeros(V3**3, dtype=torch.float64)
    for code, (a, b, c) in enumerate(itertools.product(range(V3), repeat=3)):
        pr = 1.0
        for j, t in enumerate((a, b, c)):
            pr *= float(_probs(T_TABLE, PROMPT + [a, b, c][:j], params)[t])
        out[code] = pr
    return out


def _codes(tokens: torch.Tensor) -> torch.Tensor:
    return tokens[:, 0] * V3 * V3 + tokens[:, 1] * V3 + tokens[:, 2]


PARAMS = {
    "plain": SamplingParams(temperature=1.0),
    "filtered": SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
}


@pytest.mark.parametrize("setting", list(PARAMS))
@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_suffix_and_hybrid_emit_the_targets_distribution(kind: str, setting: str) -> None:
    params = PARAMS[setting]
    if kind == "suffix":
        drafter: SuffixDrafter | HybridDrafter = SuffixDrafter(V3, SETTINGS, max_sessions=B + 1)
    else:
        drafter = HybridDrafter(TableDrafter(), SETTINGS, threshold=1.0, adaptive_k=False, max_sessions=B + 1)
    _seed_index(drafter)
    out = generate3(drafter, params, [3 * i + 1 for i in range(B)])
    pv = chi2_pvalue(_codes(out), exact_joint(params))
    assert pv > PASS_P, f"{kind}/{setting}: p-value {pv:.3g}"
    if kind == "hybrid":  # both sources drafted
        assert drafter.stats.proposals["suffix"] > B // 10 and drafter.stats.proposals["model"] > B // 10
    else:
        assert drafter.proposals_by_source["global"] > B // 10


def test_a_hybrid_that_sends_the_models_q_with_a_suffix_token_is_caught() -> None:
    params = PARAMS["plain"]
    drafter = HybridDrafter(TableDrafter(), SETTINGS, threshold=1.0, adaptive_k=False, max_sessions=B + 1)
    _seed_index(drafter)
    out = generate3(drafter, params, [3 * i + 1 for i in range(B)], mislabel_q=True)
    pv = chi2_pvalue(_codes(out), exact_joint(params))
    assert pv < 1e-6, f"p-value {pv:.3g}: the test cannot see a source-mixing bug"
