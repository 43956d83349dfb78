"""`specd distill` on the tiny pair: the loss falls, acceptance rises, resume, compact form, reduced head.

One distillation run (module fixture, a few seconds on one thread) feeds
most tests; everything runs on the tiny random Llama target.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.draft.ngram import NgramDrafter
from specd.core.errors import FailedPrecondition, InvalidArgument
from specd.core.inprocess import speculative_generate
from specd.core.model.catalog import demo_draft_path, load_draft_for_serving
from specd.core.model.draft_checkpoint import COMPACT_META, assemble, install_reduced_head
from specd.core.model.loading import load_pretrained
from specd.core.model.reduced_head import ReducedLMHead
from specd.core.model.runner import CausalLMRunner
from specd.core.rounds.steps import ProposeRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from specd.tools import cli
from specd.tools.distill import DistillConfig, build_draft, builtin_prompts, render_prompt, run_distill

GREEDY = SamplingParams(temperature=0.0)
TRAIN_PROMPTS = [f"{w} number {i}" for i in range(12) for w in ("alpha", "tell me about", "count to")]
HELDOUT = [f"{w} number {i}" for i in (40, 77, 123) for w in ("alpha", "tell me about", "count to")]  # unseen
TEXT = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(400))
VOCAB = 160  # of the tiny tokenizer's 259 ids


@pytest.fixture(scope="module")
def distilled(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 1-layer draft distilled from the tiny target through the CLI (generations + a text file)."""
    target, _ = tiny_pair
    root = tmp_path_factory.mktemp("distill")
    (root / "prompts.json").write_text(json.dumps(TRAIN_PROMPTS))
    (root / "text.txt").write_text(TEXT)
    out = root / "draft"
    argv = [
        "distill",
        "--target",
        str(target),
        "--out",
        str(out),
        "--layers",
        "1",
        "--vocab",
        str(VOCAB),
        "--source",
        "generations",
        "--source",
        str(root / "text.txt"),
        "--prompts",
        str(root / "prompts.json"),
        "--num-prompts",
        "36",
        "--gen-tokens",
        "48",
        "--gen-batch",
        "12",
        "--corpus-tokens",
        "4000",
        "--seq-len",
        "128",
        "--batch-size",
        "8",
        "--steps",
        "150",
        "--lr",
        "3e-3",
        "--warmup",
        "10",
        "--eval-every",
        "50",
        "--checkpoint-every",
        "50",
        "--val-fraction",
        "0.1",
        "--threads",
        "1",
        "--no-progress",
    ]
    torch.manual_seed(0)
    assert cli.main(argv) == 0
    return out, json.loads((out / "distill-summary.json").read_text())


def _acceptance(target: Path, drafter: ModelDrafter, prompts: list[str]) -> tuple[float, bool]:
    """Greedy acceptance rate over prompts, and whether every output equals target-only decoding."""
    loaded = load_pretrained(target)
    verifier = Verifier(CausalLMRunner(loaded.model))
    accepted = drafted = 0
    exact = True
    for p in prompts:
        ids = render_prompt(loaded.tokenizer, p, chat=True)
        ref = speculative_generate(ids, verifier, None, GREEDY, draft_length=0, max_new_tokens=32)
        got = speculative_generate(ids, verifier, drafter, GREEDY, draft_length=4, max_new_tokens=32)
        exact &= got.token_ids == ref.token_ids
        accepted += got.stats.accepted_tokens
        drafted += got.stats.draft_tokens
    return accepted / drafted, exact


def test_loss_falls_and_acceptance_rises(distilled: tuple[Path, dict], tiny_pair: tuple[Path, Path]) -> None:
    out, summary = distilled
    target, _ = tiny_pair
    first, last = summary["initial"], summary["final"]
    assert summary["steps"] == 150
    assert last["val_kl"] < 0.8 * first["val_kl"]  # KL(p_target || q_draft) on held-out sequences
    assert last["val_top1"] > first["val_top1"]
    assert summary["head_tokens"] == VOCAB

    # Acceptance on prompts not used in training, against the untrained draft (the same cut of
    # the target, with the same reduced head): trained must accept more, both must be exact.
    trained, _, token_map = load_draft_for_serving(out, "cpu")
    assert token_map is not None and len(token_map) == VOCAB
    untrained = build_draft(load_pretrained(target).model, 1, "target", 0)
    install_reduced_head(untrained, out)
    a_trained, exact_trained = _acceptance(
        target, ModelDrafter(CausalLMRunner(trained.model), token_map=token_map), HELDOUT
    )
    a_untrained, exact_untrained = _acceptance(
        target, ModelDrafter(CausalLMRunner(untrained.eval()), token_map=token_map), HELDOUT
    )
    assert exact_trained and exact_untrained
    print(f"greedy acceptance on held-out prompts: trained {a_trained:.3f}, untrained {a_untrained:.3f}")
    assert a_trained > 1.5 * a_untrained and a_trained > a_untrained + 0.02, (a_trained, a_untrained)


def test_compact_form_assembles_to_the_same_draft(
    distilled: tuple[Path, dict], tiny_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    out, _ = distilled
    target, _ = tiny_pair
    compact = out / "compact"
    borrowed = json.loads((compact / COMPACT_META).read_text())["borrowed"]
    assert "model.embed_tokens.weight" in borrowed  # not shipped: rebuilt from the target
    folder = assemble(compact, target, tmp_path / "assembled")
    assert assemble(compact, target, tmp_path / "assembled") == folder  # second call: already built
    a, _, map_a = load_draft_for_serving(out, "cpu")
    b, _, map_b = load_draft_for_serving(folder, "cpu")
    assert torch.equal(map_a, map_b)
    x = torch.tensor([[257, 104, 105, 10, 258]])
    la, lb = a.model(input_ids=x).logits, b.model(input_ids=x).logits
    assert torch.equal(torch.isinf(la), torch.isinf(lb))
    finite = torch.isfinite(la)
    assert torch.allclose(la[finite], lb[finite], atol=5e-2)  # float16 storage of the trained layers
    assert int(finite[0, 0].sum()) == VOCAB  # q = 0 off the reduced head

    # The demo-draft path refuses a target with another tokenizer, and missing assets, with a clear error.
    meta = json.loads((compact / COMPACT_META).read_text())
    meta["vocab_hash"] = "0" * 64
    other = tmp_path / "other"
    other.mkdir()
    for f in compact.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / COMPACT_META).write_text(json.dumps(meta))
    with pytest.raises(FailedPrecondition, match="tokenizer"):
        assemble(other, target, tmp_path / "mismatch")
    # No shipped weights: the demo draft falls back to an untrained cut of the target.
    cut = demo_draft_path(tmp_path / "cache", str(target), assets=tmp_path / "nothing")
    assert AutoConfig.from_pretrained(cut).num_hidden_layers == min(
        4, AutoConfig.from_pretrained(target).num_hidden_layers
    )


def test_resume_continues_from_the_checkpoint(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, _ = tiny_pair
    (tmp_path / "text.txt").write_text(TEXT)
    cfg = DistillConfig(
        target=target,
        out=tmp_path / "d",
        layers=1,
        vocab=0,
        sources=[str(tmp_path / "text.txt")],
        corpus_tokens=2000,
        seq_len=64,
        batch_size=4,
        steps=10,
        eval_every=5,
        checkpoint_every=5,
        progress=False,
    )
    first = run_distill(cfg)
    assert first["steps"] == 10
    with pytest.raises(FailedPrecondition, match="--resume"):
        run_distill(cfg)
    cfg.steps, cfg.resume = 16, True
    second = run_distill(cfg)
    assert second["steps"] == 16
    assert [h["step"] for h in second["history"]][:3] == [0, 5, 10]  # history carried over, not restarted
    cfg.layers = 2
    with pytest.raises(FailedPrecondition, match="same settings"):
        run_distill(cfg)


def test_reduced_head_drafter_samples_only_its_tokens(distilled: tuple[Path, dict]) -> None:
    out, _ = distilled
    loaded, runner, token_map = load_draft_for_serving(out, "cpu")
    assert isinstance(loaded.model.get_output_embeddings(), ReducedLMHead)
    assert runner.vocab_size == 259  # the full token space: any target token can be fed in
    drafter = ModelDrafter(runner, token_map=token_map, wire_top_k=8)
    allowed = set(token_map.tolist())
    prompt = [256, *range(1, 40)]  # includes ids outside the head: inputs are unrestricted
    drafter.open("s", prompt, SamplingParams(temperature=1.3, seed=5))
    p = drafter.propose(ProposeRequest("s", len(prompt), len(prompt), [], 6))
    assert len(p.token_ids) == 6 and set(p.token_ids) <= allowed
    assert p.q_ids is not None and p.q_probs is not None
    assert set(p.q_ids[p.q_probs > 0].tolist()) <= allowed
    for i, t in enumerate(p.token_ids):  # the token was drawn from the q that is sent
        assert float(p.q_probs[i][p.q_ids[i] == t].sum()) > 0
    Proposal.from_wire(p.token_ids, p.to_wire(), 259)  # what the target accepts off the wire
    with pytest.raises(InvalidArgument, match="twice"):
        ModelDrafter(runner, token_map=torch.tensor([1, 1]))


def test_builtin_prompts_avoid_the_demo_heldout_set() -> None:
    heldout = json.loads(
        (Path(__file__).resolve().parents[2] / "specd/assets/demo-draft/heldout-prompts.json").read_text()
    )
    prompts = builtin_prompts(2000, seed=0)
    assert len(prompts) == len(set(prompts)) == 2000
    assert len(heldout["prompts"]) >= 30 and not set(heldout["prompts"]) & set(prompts)


def test_cli_rejects_bad_settings(tiny_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target, _ = tiny_pair
    assert cli.main(["distill", "--target", str(target), "--out", str(tmp_path), "--layers", "9"]) == 2
    assert "--layers 9 is more than the target's 3" in capsys.readouterr().err
    assert cli.main(["distill", "--target", str(target), "--out", str(tmp_path), "--source", "nope"]) == 2
    assert "--source 'nope'" in capsys.readouterr().err


def test_ngram_drafts_that_are_accepted_keep_the_drafter_in_step(tiny_pair: tuple[Path, Path]) -> None:
    """Rounds after accepted n-gram drafts: the drafter's sequence holds its drafts (no SessionOutOfSync)."""

    target, _ = tiny_pair
    loaded = load_pretrained(target)
    verifier = Verifier(CausalLMRunner(loaded.model))
    prompt = list(loaded.tokenizer("the cat the cat the cat", add_special_tokens=False).input_ids)
    ref = speculative_generate(prompt, verifier, None, GREEDY, draft_length=0, max_new_tokens=60)
    got = speculative_generate(
        prompt, verifier, NgramDrafter(verifier.vocab_size), GREEDY, draft_length=4, max_new_tokens=60
    )
    assert got.token_ids == ref.token_ids
    assert got.stats.accepted_tokens >= 3  # some drafts were accepted, and later rounds still lined up
