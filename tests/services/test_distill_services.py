"""A `--draft ngram` draft service (the drafter `specd distill`'s tests compare against) through the services."""

from __future__ import annotations

from pathlib import Path

from specd.core.inprocess import speculative_generate
from specd.core.model.loading import load_pretrained
from specd.core.model.runner import CausalLMRunner
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from tests.cluster import Cluster

GREEDY = SamplingParams(temperature=0.0)


def test_ngram_drafter_through_the_services(
    tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, tmp_path: Path
) -> None:
    """`--draft ngram`: the services give exactly the in-process target-only tokens, with drafts verified."""

    target, _ = tiny_pair
    loaded = load_pretrained(target)
    verifier = Verifier(CausalLMRunner(loaded.model))
    prompts = ["abc abc abc abc abc abc", "def f(x):\n    return x\n\ndef f(x):"]
    ngram = Cluster(target, "ngram", cache_dir=tmp_path, borrow_target=tiny_cluster)
    with ngram as cluster, cluster.client() as client:
        for text in prompts:
            ids = list(loaded.tokenizer(text, add_special_tokens=False).input_ids)
            ref = speculative_generate(ids, verifier, None, GREEDY, draft_length=0, max_new_tokens=24)
            got = client.generate(
                ids, max_new_tokens=24, temperature=0.0, ignore_eos=True, speculation="fixed", draft_length=4
            )
            assert list(got.token_ids) == ref.token_ids and len(ref.token_ids) == 24
            assert got.stats.draft_tokens > 0
