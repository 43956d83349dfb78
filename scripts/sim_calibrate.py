#!/usr/bin/env python
"""Measure a real draft/target pair on this machine and fit an emulated-accelerator profile to it.

For the target and the draft, in this process, with the thread counts the
bench gives them (target 2, draft 1):

1. forward passes over a grid of batch sizes, new positions per session and
   context lengths (median of --reps each) -> least-squares fit of the
   CostModel terms (fixed, per new position, per sequence, per context token);
2. real speculative rounds at K=4 (one session, greedy, the drafter and the
   verifier of specd, the demo prompts): draft compute (4 steps), target
   verify compute (forward + rejection sampler) and the round (both), median;

then re-runs the same rounds on a SimRunner with the fitted profile and
prints the emulated against the measured round. The whole measurement
repeats --repeats times (the machine may be loaded: medians of the
repeats are reported, every repeat is printed). --write FILE writes the
profile JSON (cost models and `measured` figures) with the command line
and date in it.

    .venv/bin/python scripts/sim_calibrate.py [--target DIR --draft DIR] [--repeats 3] [--write specd/core/model/sim/profiles/cpu-demo-pair.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from specd.core.draft.model_drafter import ModelDrafter
from specd.core.model import catalog
from specd.core.model.runner import CausalLMRunner, KVSession
from specd.core.model.sim.cost import CostModel
from specd.core.model.sim.profile import PROFILES_DIR, load_profile
from specd.core.phases import FORWARD
from specd.core.rounds.steps import ProposeRequest, VerifyRequest
from specd.core.sampling.proposal import Proposal
from specd.core.sampling.sampler import SamplingParams
from specd.core.target.verifier import Verifier
from specd.serving.config import default_cache_dir

PROMPTS = Path(__file__).resolve().parent.parent / "specd" / "prompts" / "bench.jsonl"
K = 4


def timed_forward(runner: CausalLMRunner, sessions: list[KVSession], new: int) -> float:
    """ms of one pass running `new` fresh positions per session (appended, then rolled back)."""
    lengths = [len(s.tokens) for s in sessions]
    for s in sessions:
        runner.append(s, [random.randrange(256) for _ in range(new)])
    t0 = time.perf_counter()
    runner.logits_batch(sessions, [new] * len(sessions)) if len(sessions) > 1 else runner.logits(sessions[0], new)
    ms = (time.perf_counter() - t0) * 1e3
    for s, n in zip(sessions, lengths):
        runner.truncate(s, n)
    return ms


def grid(runner: CausalLMRunner, news: list[int], batches: list[int], contexts: list[int], reps: int) -> list[tuple]:
    """[(B, new, context, median ms)] over the grid; sessions prefilled first (not timed)."""
    out = []
    for ctx in contexts:
        for b in batches:
            sessions = [runner.new_session([random.randrange(256) for _ in range(ctx)]) for _ in range(b)]
            for s in sessions:
                runner.logits(s, 1)  # prefill, untimed
            for new in news:
                timed_forward(runner, sessions, new)  # warm-up
                ms = statistics.median(timed_forward(runner, sessions, new) for _ in range(reps))
                out.append((b, new, ctx, ms))
    return out


def fit(points: list[tuple], anchor: tuple[int, int, int, float]) -> CostModel:
    """Least squares for per_token and per_seq (>= 0); fixed set so the model hits `anchor` exactly.

    No KV (attention) term: on a CPU at these context lengths it is below the noise of a shared machine.
    """
    rows = np.array([[b * new, b] for b, new, ctx, _ in points], dtype=np.float64)
    y = np.array([ms for *_, ms in points], dtype=np.float64)
    design = np.hstack([np.ones((len(rows), 1)), rows])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    per_token, per_seq = (max(0.0, float(c)) for c in coef[1:])
    b, new, _ctx, ms = anchor
    fixed = ms - per_token * b * new - per_seq * b
    return CostModel(fixed_ms=round(max(0.0, fixed), 3), per_token_ms=round(per_token, 4), per_seq_ms=round(per_seq, 4))


def rounds(verifier: Verifier, drafter: ModelDrafter, prompts: list[list[int]], tokens: int) -> dict[str, list[float]]:
    """Greedy K=4 rounds, one session at a time: per round the draft, verify and round wall ms, and the
    forward-pass ms inside them (the phases the drafter and verifier record)."""
    out: dict[str, list[float]] = {k: [] for k in ("draft_ms", "verify_ms", "round_ms", "draft_fwd", "verify_fwd")}
    params = SamplingParams(temperature=0.0)
    for i, prompt in enumerate(prompts):
        sid = f"cal-{i}"
        verifier.open(sid, prompt, params)
        drafter.open(sid, prompt, params)
        committed, known = list(prompt), len(prompt)
        try:
            while len(committed) - len(prompt) < tokens:
                t0 = time.perf_counter()
                proposal: Proposal = drafter.propose(ProposeRequest(sid, len(committed), known, committed[known:], K))
                t1 = time.perf_counter()
                outcome = verifier.verify(VerifyRequest(sid, len(committed), proposal))
                t2 = time.perf_counter()
                known = len(committed) + outcome.accepted
                committed += proposal.token_ids[: outcome.accepted] + [outcome.token_id]
                out["draft_ms"].append((t1 - t0) * 1e3)
                out["verify_ms"].append((t2 - t1) * 1e3)
                out["round_ms"].append((t2 - t0) * 1e3)
                out["draft_fwd"].append(proposal.phases.total_ms(FORWARD))
                out["verify_fwd"].append(outcome.phases.total_ms(FORWARD))
        finally:
            verifier.close(sid)
            drafter.close(sid)
    return out


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {k: round(statistics.median(v), 2) for k, v in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="demo")
    parser.add_argument("--draft", default="demo")
    parser.add_argument("--target-threads", type=int, default=2)
    parser.add_argument("--draft-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="timed passes per grid point")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--base", default="cpu-demo-pair", help="profile whose shape, sources and notes are kept")
    parser.add_argument("--write", default="", help="write the fitted profile JSON here")
    args = parser.parse_args()
    random.seed(0)
    cache = default_cache_dir()
    target_dir = catalog.target_folder(args.target, cache)
    draft_dir = catalog.draft_folder(args.draft, args.target, cache)
    t_loaded, t_runner = catalog.load_for_serving(target_dir, "cpu")
    _, d_runner, token_map = catalog.load_draft_for_serving(draft_dir, "cpu")
    tok = t_loaded.tokenizer
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts[: args.prompts]
    ]
    prompts = [tok(c, add_special_tokens=False).input_ids for c in chats]
    mean_ctx = int(statistics.mean(len(p) for p in prompts)) + args.tokens // 2
    print(f"target {target_dir.name} ({args.target_threads} threads), draft {draft_dir.name} ({args.draft_threads})")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()}", flush=True)

    repeats = []  # (measured figures, target fit, draft fit) per repeat
    for rep in range(args.repeats):
        torch.set_num_threads(args.target_threads)
        pts_t = grid(t_runner, [1, K + 1], [1, 2, 4], [32, 128], args.reps)
        torch.set_num_threads(args.draft_threads)
        pts_d = grid(d_runner, [1, 2], [1, 2, 4], [32, 128], args.reps)
        # The rounds: each model with its own thread count (set around its calls).
        verifier = Verifier(_Threads(t_runner, args.target_threads))  # type: ignore[arg-type]
        drafter = ModelDrafter(_Threads(d_runner, args.draft_threads), token_map=token_map)  # type: ignore[arg-type]
        got = medians(rounds(verifier, drafter, prompts, args.tokens))
        # Slopes from the grid; the fixed term from the forwards inside the rounds (one session
        # at the rounds' mean context: K + 1 new positions for a verify, 1 for a draft step).
        fit_t = fit(pts_t, (1, K + 1, mean_ctx, got["verify_fwd"]))
        fit_d = fit(pts_d, (1, 1, mean_ctx, got["draft_fwd"] / K))
        got["load_average_1min"] = round(os.getloadavg()[0], 1)
        got["grid_target"] = [list(p) for p in pts_t]  # (batch, new positions, context, median ms)
        got["grid_draft"] = [list(p) for p in pts_d]
        repeats.append((got, fit_t, fit_d))
        shown = {k: v for k, v in got.items() if not k.startswith("grid")}
        print(f"repeat {rep + 1}: measured {shown}\n  target fit {fit_t}\n  draft fit  {fit_d}", flush=True)

    # The repeat with the median round: its figures and fits belong together.
    repeats.sort(key=lambda r: r[0]["round_ms"])
    final, cost_t, cost_d = repeats[len(repeats) // 2]
    measured = [r[0] for r in repeats]
    print(f"median repeat: measured {final}\n  target {cost_t}\n  draft  {cost_d}")

    base = json.loads((PROFILES_DIR / f"{args.base}.json").read_text())
    base["target"]["cost"] = {k: v for k, v in vars(cost_t).items() if v}
    base["draft"]["cost"] = {k: v for k, v in vars(cost_d).items() if v}
    base["target"]["kv_bytes_per_token"] = t_runner.kv_bytes_per_token
    base["draft"]["kv_bytes_per_token"] = d_runner.kv_bytes_per_token
    base["target"]["hardware"] = (
        f"{os.cpu_count()}-core {platform.machine()} CPU, {args.target_threads} torch thread(s)"
    )
    base["draft"]["hardware"] = f"{os.cpu_count()}-core {platform.machine()} CPU, {args.draft_threads} torch thread(s)"
    base["vocab_size"] = t_runner.vocab_size
    base["max_context"] = t_runner.max_context
    base["measured"] = {
        "k": K,
        "round_ms_p50": final["round_ms"],
        "draft_ms_p50": final["draft_ms"],
        "verify_ms_p50": final["verify_ms"],
        "verify_forward_ms_p50": final["verify_fwd"],
        "draft_forward_ms_p50": final["draft_fwd"],
        "prompt_lengths": [len(p) for p in prompts],
        "new_tokens": args.tokens,
        "threads": {"target": args.target_threads, "draft": args.draft_threads},
        "repeats": measured,
        "command": "scripts/sim_calibrate.py " + " ".join(sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, load average at end {os.getloadavg()}",
    }

    # The same rounds on the emulator with the fitted profile.
    path = Path(args.write) if args.write else Path("/tmp/specd-sim-calibrated.json")
    path.write_text(json.dumps(base, indent=2) + "\n")
    profile = load_profile(str(path))
    emulated = medians(
        rounds(
            Verifier(profile.runner("target")),
            ModelDrafter(profile.runner("draft")),
            [[t % profile.vocab_size for t in p] for p in prompts],
            args.tokens,
        )
    )
    ratio = emulated["round_ms"] / final["round_ms"]
    print(f"emulated {emulated} -> round emulated/measured {ratio:.3f}; profile written to {path}")
    return 0


class _Threads:
    """A runner whose forwards run with a given torch thread count (two models in one process)."""

    def __init__(self, runner: CausalLMRunner, threads: int) -> None:
        self._runner, self._threads = runner, threads

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def logits(self, *a, **kw):
        torch.set_num_threads(self._threads)
        return self._runner.logits(*a, **kw)

    def logits_batch(self, *a, **kw):
        torch.set_num_threads(self._threads)
        return self._runner.logits_batch(*a, **kw)


if __name__ == "__main__":
    raise SystemExit(main())
