"""`--draft suffix` and `--draft suffix+MODEL` through the three services (tiny models, 127.0.0.1).

The draft service learns each finished session: requests run in sequence and
each waits until the draft has indexed the previous one (its metrics say so),
so the in-process loop with a fresh drafter fed the same sequence is an exact
reference, greedy and seeded. The requests are one tenant (one cache salt); what
they taught drafts for that tenant only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from specd.core.draft.hybrid import HybridDrafter
from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.suffix import SuffixDrafter
from specd.core.inprocess import speculative_generate
from specd.core.model.runner import CausalLMRunner
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from specd.tools import cli
from tests.cluster import Cluster, metrics_address, scrape, total
from tests.references import loaded

TEXTS = ["abc abc abc", "the cat sat on the mat", "abc abc abc abc", "the cat sat on the mat, the cat"]
N = 20
SALT = "suffix-services-tenant"


def _index_documents(address: str) -> float:
    return total(scrape(address), "specd:draft_suffix_index_documents")


def _wait_for_documents(address: str, n: int, timeout_s: float = 30.0) -> None:
    """The coordinator closes a session after answering: wait until the draft has indexed it."""
    deadline = time.monotonic() + timeout_s
    while _index_documents(address) < n:
        assert time.monotonic() < deadline, f"the draft indexed {_index_documents(address)} of {n} sessions"
        time.sleep(0.05)


def _run(
    cluster: Cluster, target: Path, params_for: Callable[[int], SamplingParams], k: int, done: int = 0
) -> list[list[int]]:
    """TEXTS in sequence; `done`: sessions the draft indexed before."""
    tok = loaded(str(target)).tokenizer
    metrics = metrics_address(cluster.draft)
    out = []
    with cluster.client() as client:
        for i, text in enumerate(TEXTS):
            p = params_for(i)
            got = client.generate(
                list(tok(text, add_special_tokens=False).input_ids),
                max_new_tokens=N,
                temperature=p.temperature,
                top_p=p.top_p,
                seed=p.seed,
                ignore_eos=True,
                speculation="fixed",
                draft_length=k,
                cache_salt=SALT,
            )
            assert got.stats.completion_tokens == N
            out.append(list(got.token_ids))
            _wait_for_documents(metrics, done + i + 1)
    return out


def _in_process(target: Path, drafter, params_for: Callable[[int], SamplingParams], k: int) -> list[list[int]]:
    tok = loaded(str(target)).tokenizer
    verifier = Verifier(CausalLMRunner(loaded(str(target)).model))
    out = []
    for i, text in enumerate(TEXTS):
        ids = list(tok(text, add_special_tokens=False).input_ids)
        got = speculative_generate(
            ids, verifier, drafter, params_for(i), draft_length=k, max_new_tokens=N, tenant="the-tests"
        )
        out.append(got.token_ids)
    return out


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0)


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=70 + i)


def test_suffix_through_the_services_equals_the_in_process_loop(
    tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, _ = tiny_pair
    vocab = Verifier(CausalLMRunner(loaded(str(target)).model)).vocab_size
    greedy_ref = _in_process(target, None, _greedy, 0)  # target-only
    reference = SuffixDrafter(vocab)  # fed the same sequence as the service: seeded, then greedy
    seeded_ref = _in_process(target, reference, _seeded, 4)
    assert _in_process(target, reference, _greedy, 4) == greedy_ref
    args = ["--metrics-port", "0", "--suffix-index-bytes", str(1 << 20)]
    with Cluster(target, "suffix", cache_dir=tmp_path, draft_args=args, borrow_target=tiny_cluster) as cluster:
        assert _run(cluster, target, _seeded, 4) == seeded_ref
        assert _run(cluster, target, _greedy, 4, done=len(TEXTS)) == greedy_ref
        samples = scrape(metrics_address(cluster.draft))
        assert total(samples, "specd:draft_suffix_index_documents") == 2 * len(TEXTS)
        assert total(samples, "specd:draft_suffix_index_tokens") > 0
        assert 0 < total(samples, "specd:draft_suffix_index_bytes") <= 1 << 20
        assert total(samples, "specd:draft_suffix_index_budget_bytes") == 1 << 20
        # `specd generate` says what speculation got (stderr; stdout stays the text)
        capsys.readouterr()
        argv = ["generate", "--address", cluster.address, "--max-new-tokens", "16", "--temperature", "0"]
        assert cli.main([*argv, "--draft-length", "4", "abc abc abc abc abc"]) == 0
        out = capsys.readouterr()
        assert re.search(r"\[acceptance \d\.\d\d \(\d+ of \d+ draft tokens\), [\d.]+ tokens per round", out.err)
        assert "acceptance" not in out.out
        assert cli.main([*argv, "--no-speculation", "abc"]) == 0
        assert "no draft tokens verified" in capsys.readouterr().err
        _check_tenants(cluster, target)


def _check_tenants(cluster: Cluster, target: Path) -> None:
    """A secret one tenant's request held drafts for that tenant, and for no other caller."""
    tok = loaded(str(target)).tokenizer
    metrics = metrics_address(cluster.draft)

    def draft_tokens(text: str, salt: str) -> int:
        ids = list(tok(text, add_special_tokens=False).input_ids)
        with cluster.client() as client:
            got = client.generate(
                ids,
                max_new_tokens=8,
                temperature=0.0,
                ignore_eos=True,
                speculation="fixed",
                draft_length=4,
                cache_salt=salt,
            )
        return int(got.stats.draft_tokens)

    probe = "the vault code is 4815"
    learnt = _index_documents(metrics)
    # before the victim's request: what the probe gets from its own tokens (fresh tenants, and nobody)
    intruder_before, anonymous_before = draft_tokens(probe, "intruder-1"), draft_tokens(probe, "")
    _wait_for_documents(metrics, learnt + 1)  # the intruder's probe, in its own tenant (the anonymous: none)
    draft_tokens("note: the vault code is 48159263, keep it", "victim")
    _wait_for_documents(metrics, learnt + 2)
    intruder_after, anonymous_after = draft_tokens(probe, "intruder-2"), draft_tokens(probe, "")
    # the victim's text drafts for neither another tenant nor an anonymous caller
    assert (intruder_after, anonymous_after) == (intruder_before, anonymous_before)
    # the victim's own requests still draft from it
    assert draft_tokens(probe, "victim") > intruder_after


def test_hybrid_through_the_services_equals_the_in_process_loop(
    tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, tmp_path: Path
) -> None:
    target, draft = tiny_pair

    def hybrid() -> HybridDrafter:
        return HybridDrafter(ModelDrafter(CausalLMRunner(loaded(str(draft)).model)), threshold=1.0, adaptive_k=False)

    greedy_ref = _in_process(target, None, _greedy, 0)
    reference = hybrid()
    seeded_ref = _in_process(target, reference, _seeded, 3)
    assert _in_process(target, reference, _greedy, 3) == greedy_ref
    args = ["--metrics-port", "0", "--no-hybrid-adaptive-k", "--hybrid-threshold", "1.0"]
    with Cluster(target, f"suffix+{draft}", cache_dir=tmp_path, draft_args=args, borrow_target=tiny_cluster) as cluster:
        assert _run(cluster, target, _seeded, 3) == seeded_ref
        assert _run(cluster, target, _greedy, 3, done=len(TEXTS)) == greedy_ref
