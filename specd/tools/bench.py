"""`specd bench`: every decoding mode side by side, in one run, on the same services and prompts.

    specd bench --quick                          # demo pair, small grid, a few minutes
    specd bench --json out/bench.json            # full grid: T 0 and 0.7, 1 and 8 clients, K 4
    specd bench --address HOST:PORT --target DIR --draft DIR   # services already running

What a run does:

1. starts target, draft and coordinator as processes (specd.tools.localcluster), or
   connects to running ones (--address);
2. measures the cost ratio c in-process: draft time per token / target time
   per forward (one token with a warm KV cache, median of N);
3. for each cell (temperature x concurrent clients), runs the shipped prompt
   set through every mode: `target-only` (the baseline: speculation off,
   through the same services), `fixed-K`, `auto`, ... over the Coordinator
   API (streaming, timed per message), and the peer, Hugging Face
   transformers' assisted generation, in this process on the same pair;
4. checks that every mode's greedy (T = 0) output equals target-only's;
5. writes JSON (one record per mode x temperature x concurrency), a
   markdown table and a PNG plot.

Modes are data (`Mode`: a name, a runner, request options). A new request
option becomes a mode by adding one line to SERVICE_MODES or
SERVICE_FAMILIES below, or without any code change with
``--custom-mode 'NAME:key=value,...'`` (the keys are CoordinatorClient
request options). docs/bench.md defines every reported number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import secrets
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUNNER_SERVICE = "service"  # through the Coordinator API of the services
RUNNER_HF = "hf"  # transformers' generate(), in this process (the peer)

BASELINE = "target-only"

# ---- modes --------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One way to decode: what the bench runs for each prompt of a cell.

    runner "service": `request` are CoordinatorClient.generate_stream keyword
    options (speculation, draft_length, and whatever the API grows).
    runner "hf": `request` are assisted-generation settings set on the
    draft's generation_config (num_assistant_tokens, ...); {"assistant":
    False} runs the target alone.
    draft_length: K for the theoretical speed-up S(K); None when the mode
    picks K itself (then the measured mean draft length is used).
    """

    name: str
    runner: str
    request: Mapping[str, Any] = field(default_factory=dict)
    draft_length: int | None = None

    @property
    def baseline(self) -> bool:
        return self.name == BASELINE

    @property
    def peer(self) -> bool:
        return self.runner == RUNNER_HF


# Single modes of the services, by name: request options. Extension point: add a line per new option.
SERVICE_MODES: dict[str, dict[str, Any]] = {
    BASELINE: {"speculation": "off"},
    "auto": {"speculation": "auto"},  # adaptive K (the coordinator picks K per session); server's pipelining default
    "auto-pipelined": {"speculation": "auto", "pipeline": True},
}

# Families of the services: NAME-K (or bare NAME: one mode per --draft-lengths K).
SERVICE_FAMILIES: dict[str, Callable[[int], dict[str, Any]]] = {
    "fixed": lambda k: {"speculation": "fixed", "draft_length": k, "pipeline": False},
    "pipelined": lambda k: {"speculation": "fixed", "draft_length": k, "pipeline": True},  # bonus-match pipelining
    "postverify": lambda k: {"speculation": "fixed", "draft_length": k, "pipeline": "post-verify"},  # PEARL's
}

# The peer: transformers' assisted generation. hf-K: K assistant tokens, constant
# schedule, no confidence early stop (like for like with fixed-K).
HF_DEFAULT = "hf-default"  # transformers' own defaults for the assistant
HF_TARGET_ONLY = "hf-target-only"  # transformers' generate() on the target alone


HF_LOOKUP = "hf-lookup"  # transformers' prompt lookup decoding: the peer of --draft ngram (hf-lookup-K)


def _hf_fixed(k: int) -> dict[str, Any]:
    return {
        "num_assistant_tokens": k,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }


DEFAULT_MODES = "target-only,fixed,pipelined,auto,hf,hf-default"


def parse_modes(spec: str, draft_lengths: Sequence[int], custom: Sequence[str] = ()) -> list[Mode]:
    """Modes from a comma list (see --modes), then --custom-mode specs; target-only always first."""
    modes: list[Mode] = []
    for raw in [s.strip() for s in spec.split(",") if s.strip()]:
        modes.extend(_expand_mode(raw, draft_lengths))
    modes.extend(parse_custom_mode(c) for c in custom)
    if not any(m.baseline for m in modes):
        modes.insert(0, Mode(BASELINE, RUNNER_SERVICE, SERVICE_MODES[BASELINE]))
    modes.sort(key=lambda m: not m.baseline)  # stable: the baseline first, the rest as given
    names = [m.name for m in modes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"mode names must be unique (repeated: {', '.join(dupes)})")
    return modes


def largest_k(modes: Sequence[Mode], draft_lengths: Sequence[int]) -> int:
    """The largest K any mode of the run drafts with (or --draft-lengths names)."""
    return max([m.draft_length or 0 for m in modes] + list(draft_lengths))


def cap_adaptive_modes(modes: Sequence[Mode], draft_lengths: Sequence[int]) -> list[Mode]:
    """Let modes that choose K themselves (auto) choose up to the largest K the run gives a fixed mode.

    Like for like: "auto is within 5% of the best fixed K" only means something
    when auto may pick that K. A mode that names its own draft_length keeps it.
    """
    k_max = largest_k(modes, draft_lengths)
    out: list[Mode] = []
    for m in modes:
        if m.runner == RUNNER_SERVICE and m.request.get("speculation") == "auto" and "draft_length" not in m.request:
            m = Mode(m.name, m.runner, {**m.request, "draft_length": k_max}, m.draft_length)
        out.append(m)
    return out


def _expand_mode(raw: str, draft_lengths: Sequence[int]) -> list[Mode]:
    if raw in SERVICE_MODES:
        return [Mode(raw, RUNNER_SERVICE, SERVICE_MODES[raw])]
    if raw == HF_DEFAULT:
        return [Mode(raw, RUNNER_HF, {})]
    if raw == HF_TARGET_ONLY:
        return [Mode(raw, RUNNER_HF, {"assistant": False})]
    family, _, k_text = raw.rpartition("-") if raw.rpartition("-")[2].isdigit() else (raw, "", "")
    ks = [int(k_text)] if k_text else list(draft_lengths)
    if family in SERVICE_FAMILIES:
        return [Mode(f"{family}-{k}", RUNNER_SERVICE, SERVICE_FAMILIES[family](k), k) for k in ks]
    if family == "hf":
        return [Mode(f"hf-{k}", RUNNER_HF, _hf_fixed(k), k) for k in ks]
    if family == HF_LOOKUP:  # no draft model: the target alone, drafting by prompt lookup
        return [Mode(f"{HF_LOOKUP}-{k}", RUNNER_HF, {"assistant": False, "prompt_lookup_num_tokens": k}, k) for k in ks]
    known = sorted(
        [
            *SERVICE_MODES,
            *(f"{f}[-K]" for f in SERVICE_FAMILIES),
            "hf[-K]",
            f"{HF_LOOKUP}[-K]",
            HF_DEFAULT,
            HF_TARGET_ONLY,
        ]
    )
    raise ValueError(f"unknown mode {raw!r}; known: {', '.join(known)} (or --custom-mode NAME:key=value,...)")


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_custom_mode(spec: str) -> Mode:
    """'NAME:key=value,key=value' -> a service mode with those request options (values: int, float, bool, str)."""
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if not sep or not name:
        raise ValueError(
            f"--custom-mode {spec!r}: expected NAME:key=value,... (e.g. fast-4:speculation=fixed,draft_length=4)"
        )
    request: dict[str, Any] = {}
    for item in [i.strip() for i in rest.split(",") if i.strip()]:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--custom-mode {spec!r}: {item!r} is not key=value")
        request[key.strip()] = _parse_value(value.strip())
    k = request.get("draft_length")
    return Mode(name, RUNNER_SERVICE, request, int(k) if isinstance(k, int) and k > 0 else None)


# ---- prompts ------------------------------------------------------------------


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str  # code | chat | prose (any label works)
    format: str  # "chat": sent as a user message through the chat template; "text": plain continuation
    prompt: str


def default_prompt_file() -> Path:
    return shipped_prompt_file("bench")


def shipped_prompt_file(name: str) -> Path:
    """A prompt set shipped with specd: 'bench' (code, chat, prose) or 'edit' (edit code given in the prompt)."""
    return Path(__file__).resolve().parents[1] / "prompts" / f"{name}.jsonl"


def load_prompts(path: Path | str | None = None) -> list[BenchPrompt]:
    """The prompt set: one JSON object per line with id, category, format (chat|text), prompt.

    path: a file, or the name of a shipped set ('bench', 'edit'); default 'bench'.
    """
    if path and not Path(path).exists() and shipped_prompt_file(str(path)).exists():
        path = shipped_prompt_file(str(path))
    path = Path(path) if path else default_prompt_file()
    out: list[BenchPrompt] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                p = BenchPrompt(
                    str(obj["id"]), str(obj["category"]), str(obj.get("format", "text")), str(obj["prompt"])
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: need a JSON object with id, category, prompt ({exc})") from exc
            if p.format not in ("chat", "text"):
                raise ValueError(f"{path}:{n}: format must be chat or text (got {p.format!r})")
            if not p.prompt:
                raise ValueError(f"{path}:{n}: empty prompt")
            out.append(p)
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: prompt ids must be unique")
    return out


def select_prompts(prompts: Sequence[BenchPrompt], n: int, categories: Sequence[str] = ()) -> list[BenchPrompt]:
    """The first n prompts taken round-robin over the categories (so any n mixes them), in file order within each."""
    pool = [p for p in prompts if not categories or p.category in categories]
    by_cat: dict[str, list[BenchPrompt]] = {}
    for p in pool:
        by_cat.setdefault(p.category, []).append(p)
    out: list[BenchPrompt] = []
    queues = [list(v) for v in by_cat.values()]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def tokenize_prompt(tokenizer: Any, p: BenchPrompt) -> list[int]:
    """Prompt token IDs, the same for every mode (the services get IDs, not text)."""
    if p.format == "chat" and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(p.prompt)["input_ids"]]


# ---- one request --------------------------------------------------------------


@dataclass
class RequestResult:
    """What one prompt gave in one mode: tokens, per-round sizes and client-side times."""

    prompt_id: str
    token_ids: list[int] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one entry per token after the first message
    round_tokens: list[int] = field(default_factory=list)  # tokens committed per round (= per stream message)
    drafted: list[int] | None = None  # draft tokens per round, when known exactly (the peer)
    stats: dict[str, Any] | None = None  # the service's GenerateStats
    error: str | None = None


class _Timeline:
    """Arrival times of token groups: TTFT from the first, per-token inter-token latency from the rest.

    A group of n tokens that arrives `gap` after the previous group counts
    n inter-token latencies of gap / n each (spread evenly).
    """

    def __init__(self, result: RequestResult) -> None:
        self.r = result
        self.prev: float | None = None

    def add(self, now: float, n: int) -> None:
        if n <= 0:
            return
        if self.prev is None:
            self.r.ttft_s = now - self.r.start
        else:
            self.r.itl_s.extend([(now - self.prev) / n] * n)
        self.prev = now
        self.r.round_tokens.append(n)


_STATS_FIELDS = (
    "rounds",
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "completion_tokens",
    "target_only_rounds",
    "pipeline_hits",
    "time_to_first_token_ms",
    "tokens_per_s",
)


def _stats_dict(stats: Any) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(stats, k) for k in _STATS_FIELDS if hasattr(stats, k)}
    if "accepted_per_position" in stats.DESCRIPTOR.fields_by_name:  # once the API carries it
        out["accepted_per_position"] = list(stats.accepted_per_position)
    return out


def run_service_request(
    client: Any, prompt_id: str, ids: list[int], options: Mapping[str, Any], metadata: Sequence[tuple[str, str]] = ()
) -> RequestResult:
    """One GenerateStream call, timed per message (one message per round)."""
    r = RequestResult(prompt_id)
    r.start = time.perf_counter()
    timeline = _Timeline(r)
    try:
        for msg in client.generate_stream(ids, metadata=metadata, **options):
            timeline.add(time.perf_counter(), len(msg.token_ids))
            r.token_ids.extend(int(t) for t in msg.token_ids)
            if msg.HasField("stats"):
                r.stats = _stats_dict(msg.stats)
    except Exception as exc:  # noqa: BLE001 - counted and reported; the run goes on
        r.error = f"{type(exc).__name__}: {getattr(exc, 'details', lambda: '')() or exc}"
    r.end = time.perf_counter()
    return r


class _HFStreamer:
    """transformers streamer: the first put is the prompt, each later put one round's tokens."""

    def __init__(self, timeline: _Timeline, draft_calls: list[int] | None, drafted: list[int] | None) -> None:
        self.timeline, self.draft_calls, self.drafted = timeline, draft_calls, drafted
        self.seen_prompt = False
        self.calls_before = 0

    def put(self, value: Any) -> None:
        now = time.perf_counter()
        if not self.seen_prompt:
            self.seen_prompt = True
        else:
            self.timeline.add(now, int(value.numel()))
            if self.drafted is not None and self.draft_calls is not None:
                self.drafted.append(self.draft_calls[0] - self.calls_before)  # draft forwards = draft tokens this round
        if self.draft_calls is not None:
            self.calls_before = self.draft_calls[0]

    def end(self) -> None:
        pass


class HFPeer:
    """transformers' generate() on the same pair, in this process (assisted generation)."""

    def __init__(self, target_model: Any, draft_model: Any | None, *, threads: int, pad_token_id: int) -> None:
        self.target, self.draft, self.threads, self.pad = target_model, draft_model, threads, pad_token_id
        self.draft_calls = [0]
        if draft_model is not None:
            draft_model.register_forward_hook(lambda *_: self.draft_calls.__setitem__(0, self.draft_calls[0] + 1))

    def configure(self, mode: Mode) -> None:
        if self.draft is None or not mode.request.get("assistant", True):
            return
        gen = self.draft.generation_config
        for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
            setattr(gen, key, mode.request.get(key))  # None: transformers' default

    def run(
        self,
        prompt_id: str,
        ids: list[int],
        mode: Mode,
        *,
        temperature: float,
        seed: int,
        max_new_tokens: int,
        stop_at_eos: bool,
    ) -> RequestResult:
        import torch

        assisted = self.draft is not None and mode.request.get("assistant", True)
        r = RequestResult(prompt_id, drafted=[] if assisted else None)
        timeline = _Timeline(r)
        streamer = _HFStreamer(timeline, self.draft_calls if assisted else None, r.drafted)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            top_k=0,
            top_p=1.0,
            pad_token_id=self.pad,
            streamer=streamer,
        )
        if temperature > 0:
            kwargs["temperature"] = temperature
        if not stop_at_eos:
            kwargs["eos_token_id"] = []  # keep going past end-of-sequence, as the services' ignore_eos
        if assisted:
            kwargs["assistant_model"] = self.draft
        if mode.request.get("prompt_lookup_num_tokens"):
            kwargs["prompt_lookup_num_tokens"] = int(mode.request["prompt_lookup_num_tokens"])
        x = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        torch.manual_seed(seed)
        r.start = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            r.token_ids = [int(t) for t in out[0, len(ids) :].tolist()]
        except Exception as exc:  # noqa: BLE001 - reported; the run goes on
            r.error = f"{type(exc).__name__}: {exc}"
        finally:
            r.end = time.perf_counter()
            torch.set_num_threads(previous)
        return r


# ---- cost ratio c -------------------------------------------------------------


def measure_forward_ms(
    model: Any, prompt_ids: list[int], *, threads: int, samples: int, block: int = 1, warmup: int = 3
) -> float:
    """Median ms of one forward over `block` new tokens with a warm KV cache (CausalLMRunner, as the services)."""
    import torch

    from specd.core.runner import CausalLMRunner

    runner = CausalLMRunner(model)
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        s = runner.new_session(prompt_ids)
        runner.logits(s)  # prefill
        times: list[float] = []
        token = prompt_ids[-1]
        for i in range(samples + warmup):
            runner.append(s, [token] * block)
            t0 = time.perf_counter()
            runner.logits(s, block)
            dt = (time.perf_counter() - t0) * 1e3
            if block > 1:
                runner.truncate(s, len(s) - block + 1)  # a round keeps accepted + 1 tokens; keep 1
            if i >= warmup:
                times.append(dt)
        return percentile(times, 50)
    finally:
        torch.set_num_threads(previous)


def measure_ngram_ms(prompt_ids: list[int], *, samples: int, num_tokens: int = 4, warmup: int = 3) -> float:
    """Median ms per proposed token of the n-gram drafter (prompt lookup) over the prompt, as the draft service runs it."""
    from specd.core.drafting import NgramDrafter
    from specd.core.sampling import SamplingParams

    drafter = NgramDrafter(max(prompt_ids) + 1)
    times: list[float] = []
    for i in range(samples + warmup):
        drafter.open("probe", prompt_ids, SamplingParams(temperature=0.0))
        t0 = time.perf_counter()
        found = drafter.propose("probe", len(prompt_ids), len(prompt_ids), [], num_tokens)
        dt = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(dt / max(1, len(found.token_ids)))
    return percentile(times, 50)


def measure_cost(
    target_model: Any,
    draft_model: Any | None,
    prompt_ids: list[int],
    *,
    target_threads: int,
    draft_threads: int,
    samples: int,
    draft_lengths: Iterable[int],
) -> dict[str, Any]:
    """c = draft ms per token / target ms per 1-token forward, plus the target's K+1-token verify time.

    draft_model None: the n-gram drafter, timed per proposed token (no model, no threads).
    """
    target_ms = measure_forward_ms(target_model, prompt_ids, threads=target_threads, samples=samples)
    draft_ms = (
        measure_ngram_ms(prompt_ids, samples=samples)
        if draft_model is None
        else measure_forward_ms(draft_model, prompt_ids, threads=draft_threads, samples=samples)
    )
    verify = {
        str(k): measure_forward_ms(
            target_model, prompt_ids, threads=target_threads, samples=max(3, samples // 3), block=k + 1
        )
        for k in sorted(set(draft_lengths))
    }
    return {
        "target_ms": target_ms,
        "draft_ms": draft_ms,
        "c": draft_ms / target_ms if target_ms > 0 else None,
        "target_verify_ms": verify,  # K -> ms of one forward over K + 1 tokens
        "target_threads": target_threads,
        "draft_threads": draft_threads,
        "samples": samples,
    }


# ---- statistics -------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def expected_tokens_per_round(alpha: float, k: float) -> float:
    """Leviathan et al.: E[tokens per round] = (1 - a^(K+1)) / (1 - a) for per-token acceptance a."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


def theoretical_speedup(alpha: float, k: float, c: float) -> float:
    """S(K) = (1 - a^(K+1)) / ((1 - a)(K c + 1))."""
    return expected_tokens_per_round(alpha, k) / (k * c + 1.0)


def mixed_speedup(alpha: float, k: float, c: float, drafting_rounds: int, rounds: int) -> float:
    """Expected speed-up when only some rounds draft (K = their mean): tokens / cost, in target-forward units.

    A drafting round yields (1 - a^(K+1)) / (1 - a) tokens for K c + 1; any other
    round yields 1 token for 1. Equals S(K) when every round drafts.
    """
    plain = max(0, rounds - drafting_rounds)
    tokens = drafting_rounds * expected_tokens_per_round(alpha, k) + plain
    return tokens / (drafting_rounds * (k * c + 1.0) + plain)


def alpha_from_rounds(drafted: Sequence[int], accepted: Sequence[int]) -> float | None:
    """Per-token acceptance a, maximum likelihood under Leviathan's i.i.d. model.

    A round that drafted d tokens and accepted j has likelihood a^j (1 - a) if
    j < d (a rejection was seen), a^d if j == d. So
    a = accepted tokens / (accepted tokens + rounds with a rejection).
    """
    acc = rej = 0
    for d, j in zip(drafted, accepted):
        if d <= 0:
            continue
        acc += j
        rej += int(j < d)
    return acc / (acc + rej) if acc + rej else None


def alpha_from_acceptance_length(length: float, k: float) -> float | None:
    """The a with (1 - a^(K+1)) / (1 - a) = length (bisection): used when per-round draft sizes are unknown."""
    if not k or length is None or not math.isfinite(length):
        return None
    if length <= 1.0:
        return 0.0
    if length >= k + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, k) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---- one cell -----------------------------------------------------------------


def _drafted_for_fixed(round_tokens: Sequence[int], k: int, max_new_tokens: int) -> list[int]:
    """Draft tokens per round for a fixed-K request: min(K, remaining - 1), as the coordinator's draft_budget."""
    out, generated = [], 0
    for n in round_tokens:
        out.append(max(0, min(k, max_new_tokens - generated - 1)))
        generated += n
    return out


def summarize(
    mode: Mode,
    temperature: float,
    concurrency: int,
    results: Sequence[RequestResult],
    wall_s: float,
    *,
    max_new_tokens: int,
    cost: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One record: throughput, acceptance, theory vs measurement, latencies (speed-up and greedy check come later)."""
    ok = [r for r in results if r.error is None]
    tokens = sum(len(r.token_ids) for r in ok)
    rec: dict[str, Any] = {
        "mode": mode.name,
        "runner": mode.runner,
        "request": dict(mode.request),
        "temperature": temperature,
        "concurrency": concurrency,
        "draft_length": mode.draft_length,
        "prompts": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "speedup": None,
    }
    # -- rounds and acceptance
    accepted_rounds = [max(0, n - 1) for r in ok for n in r.round_tokens]
    per_round_drafted: list[int] | None = None
    if mode.peer:
        drafted = [d for r in ok for d in (r.drafted or [0] * len(r.round_tokens))]
        per_round_drafted = drafted
        drafts, draft_tokens = sum(1 for d in drafted if d > 0), sum(drafted)
        accepted = sum(min(a, d) for a, d in zip(accepted_rounds, drafted))
        rounds, target_only_rounds, pipeline_hits = len(drafted), 0, None
        per_position_source = "stream" if mode.request.get("assistant", True) else None
    else:
        stats = [r.stats or {} for r in ok]
        rounds = sum(s.get("rounds", 0) for s in stats)
        drafts = sum(s.get("drafts", 0) for s in stats)
        draft_tokens = sum(s.get("draft_tokens", 0) for s in stats)
        accepted = sum(s.get("accepted_tokens", 0) for s in stats)
        target_only_rounds = sum(s.get("target_only_rounds", 0) for s in stats)
        pipeline_hits = (
            sum(s.get("pipeline_hits", 0) for s in stats) if all("pipeline_hits" in s for s in stats) else None
        )
        if mode.draft_length:  # fixed K: per-round draft sizes follow from the round sizes; check against the stats
            guess = [_drafted_for_fixed(r.round_tokens, mode.draft_length, max_new_tokens) for r in ok]
            if all(
                sum(g) == s.get("draft_tokens") and sum(1 for d in g if d > 0) == s.get("drafts")
                for g, s in zip(guess, stats)
            ):
                per_round_drafted = [d for g in guess for d in g]
        per_position_source = "stream"
        if stats and all("accepted_per_position" in s for s in stats):
            per_position_source = "stats"
    rec.update(
        rounds=rounds,
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        target_only_rounds=target_only_rounds,
        pipeline_hits=pipeline_hits,
    )
    rec["pipeline_hit_rate"] = pipeline_hits / drafts if pipeline_hits is not None and drafts else None
    speculative = drafts > 0
    rec["acceptance_rate"] = accepted / draft_tokens if draft_tokens else None
    rec["acceptance_length"] = 1.0 + accepted / drafts if drafts else None
    rec["mean_draft_length"] = draft_tokens / drafts if drafts else None
    # -- per position: rounds whose i-th draft token was accepted, / rounds that drafted (vLLM's definition)
    counts: list[int] = []
    if speculative:
        if per_position_source == "stats":
            for s in (r.stats or {} for r in ok):
                for i, v in enumerate(s["accepted_per_position"]):
                    counts.extend([0] * (i + 1 - len(counts)))
                    counts[i] += int(v)
        else:
            for a in accepted_rounds:
                counts.extend([0] * (a - len(counts)))
                for i in range(a):
                    counts[i] += 1
        width = max(len(counts), int(math.ceil(rec["mean_draft_length"] or 0)), mode.draft_length or 0)
        counts.extend([0] * (width - len(counts)))
    rec["accepted_per_position"] = counts if speculative else None
    rec["acceptance_per_position"] = [c / drafts for c in counts] if speculative else None
    rec["per_position_source"] = per_position_source if speculative else None
    # -- theory: a, c, S(K), efficiency
    alpha = method = None
    if speculative and per_round_drafted is not None and len(per_round_drafted) == len(accepted_rounds):
        alpha, method = alpha_from_rounds(per_round_drafted, accepted_rounds), "rounds"
    elif speculative:
        alpha, method = alpha_from_acceptance_length(rec["acceptance_length"], rec["mean_draft_length"]), "length"
    k = float(mode.draft_length) if mode.draft_length else rec["mean_draft_length"]
    c = (cost or {}).get("c")
    rec["alpha"], rec["alpha_method"] = alpha, method
    rec["cost_ratio"] = c if speculative else None
    rec["theoretical_speedup"] = rec["theoretical_model"] = None
    if speculative and alpha is not None and c:
        if mode.draft_length:  # fixed K: Leviathan's S(K)
            rec["theoretical_speedup"], rec["theoretical_model"] = theoretical_speedup(alpha, k, c), "S(K)"
        else:  # the mode picks K and may stop drafting: drafting rounds as S(K_mean), the others as target-only
            rec["theoretical_speedup"] = mixed_speedup(alpha, k, c, drafts, rounds)
            rec["theoretical_model"] = "mixed"
    verify_ms = ((cost or {}).get("target_verify_ms") or {}).get(str(mode.draft_length))
    rec["theoretical_speedup_measured_verify"] = (
        expected_tokens_per_round(alpha, k) / (k * c + verify_ms / cost["target_ms"])  # type: ignore[index]
        if speculative and alpha is not None and c and verify_ms
        else None
    )
    rec["efficiency"] = rec["efficiency_measured_verify"] = None
    # -- latencies (client side)
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    itl = [x * 1e3 for r in ok for x in r.itl_s]
    rec["ttft_ms_p50"] = _nan_none(percentile(ttft, 50))
    rec["ttft_ms_p99"] = _nan_none(percentile(ttft, 99))
    rec["itl_ms_p50"] = _nan_none(percentile(itl, 50))
    rec["itl_ms_p99"] = _nan_none(percentile(itl, 99))
    rec["greedy_identical"] = None
    rec["greedy_mismatches"] = []
    return rec


def _nan_none(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def finish_records(
    records: list[dict[str, Any]], outputs: Mapping[tuple[str, str, float, int], Mapping[str, list[int]]]
) -> dict[str, Any]:
    """Fill speed-up and efficiency (vs target-only of the same cell) and the greedy check; return its summary.

    Greedy reference: target-only's outputs in the first temperature-0 cell run.
    """
    base = {(r.get("services", ""), r["temperature"], r["concurrency"]): r for r in records if r["mode"] == BASELINE}
    for r in records:
        b = base.get((r.get("services", ""), r["temperature"], r["concurrency"]))
        if b is None and r["runner"] == RUNNER_HF:  # the peer runs at 1 client; compare with the 1-client baseline
            b = base.get((r.get("services", ""), r["temperature"], 1))
        if b and b["tokens_per_s"] and r["tokens_per_s"] is not None:
            r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"]
            if r["theoretical_speedup"]:
                r["efficiency"] = r["speedup"] / r["theoretical_speedup"]
            if r.get("theoretical_speedup_measured_verify"):
                r["efficiency_measured_verify"] = r["speedup"] / r["theoretical_speedup_measured_verify"]
    greedy_cells = [key for key in outputs if key[2] == 0.0]
    ref_key = next((key for key in greedy_cells if key[1] == BASELINE), None)
    failures: list[dict[str, Any]] = []
    checked = 0
    if ref_key is not None:
        reference = outputs[ref_key]
        for r in records:
            key = (r.get("services", ""), r["mode"], r["temperature"], r["concurrency"])
            if r["temperature"] != 0.0 or key not in outputs:
                continue
            checked += 1
            mismatches = []
            for pid, ref in reference.items():
                got = outputs[key].get(pid)
                if got is None:
                    mismatches.append({"prompt": pid, "first_diff": None, "why": "no output (request failed)"})
                elif got != ref:
                    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                    mismatches.append({"prompt": pid, "first_diff": first, "len": len(got), "reference_len": len(ref)})
            r["greedy_identical"] = not mismatches
            r["greedy_mismatches"] = mismatches
            if mismatches:
                failures.append(
                    {
                        "mode": _row_name(r),
                        "concurrency": r["concurrency"],
                        "runner": r["runner"],
                        "prompts": [m["prompt"] for m in mismatches],
                    }
                )
    return {
        "reference": f"{BASELINE} at temperature 0, {ref_key[3]} client(s)" if ref_key else None,
        "records_checked": checked,
        "identical": not [f for f in failures if f["runner"] == RUNNER_SERVICE] if ref_key else None,
        "peer_identical": not [f for f in failures if f["runner"] == RUNNER_HF] if ref_key else None,
        "failures": failures,
    }


# ---- service set-ups and tracing -------------------------------------------------


@dataclass(frozen=True)
class ServiceSetup:
    """One way of starting the services; a run compares set-ups side by side (e.g. batching on / off)."""

    label: str  # "" when the run has a single set-up
    model_service_args: tuple[str, ...] = ()  # added to the draft's and the target's flags


BATCHING_SETUPS = {
    "on": [ServiceSetup("")],  # the services' default (--max-batch 32)
    "off": [ServiceSetup("unbatched", ("--max-batch", "1"))],
    "both": [ServiceSetup("batched"), ServiceSetup("unbatched", ("--max-batch", "1"))],
}


def untraced_metadata() -> tuple[tuple[str, str], ...]:
    """A W3C traceparent whose sampled flag is off: services with tracing on record nothing for the call."""
    return (("traceparent", f"00-{secrets.randbits(128) | 1:032x}-{secrets.randbits(64) | 1:016x}-00"),)


def measure_tracing_overhead(
    address: str,
    mode: Mode,
    items: Sequence[tuple[BenchPrompt, list[int]]],
    *,
    repeats: int,
    max_new_tokens: int,
    seed: int,
    ignore_eos: bool,
    timeout: float,
    spans: Callable[[], int],
    bar: Any,
) -> dict[str, Any]:
    """Tokens/s of `mode` with every request traced vs none, interleaved request by request.

    The services run with tracing on at 100% sampling, exporting to a real
    OTLP receiver. "off" requests carry a not-sampled traceparent, so they
    take the services' untraced path (no spans, no context in stream
    messages); "on" requests are traced and exported. Alternating the two
    per prompt (and the order per repeat) cancels the machine's drift.
    """
    from coordinator.client import CoordinatorClient

    wall = {"off": 0.0, "on": 0.0}
    tokens = {"off": 0, "on": 0}
    errors = 0
    options = dict(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=ignore_eos, **mode.request)
    with CoordinatorClient(address, timeout=timeout) as client:
        for rep in range(repeats):
            for i, (p, ids) in enumerate(items):
                order = ("off", "on") if (rep + i) % 2 == 0 else ("on", "off")
                for variant in order:
                    meta = untraced_metadata() if variant == "off" else ()
                    r = run_service_request(client, p.id, ids, dict(options, seed=seed + i), meta)
                    errors += r.error is not None
                    wall[variant] += r.end - r.start
                    tokens[variant] += len(r.token_ids)
                    bar.update(1)
    tps = {v: tokens[v] / wall[v] if wall[v] > 0 else None for v in wall}
    ratio = tps["on"] / tps["off"] if tps["on"] and tps["off"] else None
    return {
        "mode": mode.name,
        "repeats": repeats,
        "requests_per_variant": repeats * len(items),
        "errors": errors,
        "tokens_per_s_off": tps["off"],
        "tokens_per_s_on": tps["on"],
        "on_over_off": ratio,
        "overhead_pct": (1.0 - ratio) * 100 if ratio else None,
        "sample_ratio": 1.0,
        "spans_received": spans(),  # so far; the run updates it once the services have flushed
    }


def concurrency_table(
    records: Sequence[Mapping[str, Any]], temperature: float
) -> tuple[list[int], list[tuple[str, dict[int, float]]]]:
    """tokens/s per (services, mode) row and concurrency column, at one temperature."""
    cols = sorted({r["concurrency"] for r in records if r["temperature"] == temperature})
    rows: dict[str, dict[int, float]] = {}
    for r in records:
        if r["temperature"] == temperature and r["runner"] == RUNNER_SERVICE and r["tokens_per_s"] is not None:
            rows.setdefault(_row_name(r), {})[r["concurrency"]] = r["tokens_per_s"]
    return cols, list(rows.items())


def batching_gains(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """batched / unbatched tokens/s for every (mode, T, clients) measured both ways."""
    by_key = {(r.get("services", ""), r["mode"], r["temperature"], r["concurrency"]): r for r in records}
    out = []
    for (label, mode, t, c), r in by_key.items():
        other = by_key.get(("unbatched", mode, t, c))
        if label == "batched" and other and r["tokens_per_s"] and other["tokens_per_s"]:
            out.append(
                {
                    "mode": mode,
                    "temperature": t,
                    "concurrency": c,
                    "batched_tokens_per_s": r["tokens_per_s"],
                    "unbatched_tokens_per_s": other["tokens_per_s"],
                    "gain": r["tokens_per_s"] / other["tokens_per_s"],
                }
            )
    return out


def _row_name(r: Mapping[str, Any]) -> str:
    return f"{r['mode']} [{r['services']}]" if r.get("services") else r["mode"]


# ---- reports ------------------------------------------------------------------


def _fmt(x: Any, digits: int = 2, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    if isinstance(x, float):
        return f"{x:.{digits}f}{suffix}"
    return f"{x}{suffix}"


def render_markdown(report: Mapping[str, Any]) -> str:
    meta, records = report["meta"], report["records"]
    s = meta["settings"]
    piped = any(r["request"].get("pipeline") not in (None, False, "off") for r in records)
    lines = [
        "# specd bench",
        "",
        f"Target `{meta['models']['target']}`, draft `{meta['models']['draft']}`; {s['prompts']} prompts "
        f"({', '.join(s['categories'])}), {s['max_new_tokens']} new tokens each"
        f"{'' if s['stop_at_eos'] else ' (past end-of-sequence)'}; threads target {s['target_threads']}, "
        f"draft {s['draft_threads']}, peer {s['hf_threads']}; {meta['machine']['cpus']} CPUs; "
        f"{meta['duration_s']:.0f} s."
        + (
            f" Modes interleaved over up to {s['interleave']} slices of the prompts per cell."
            if s.get("interleave", 1) > 1
            else ""
        ),
        "",
        *(["**Interrupted: partial results.**", ""] if meta.get("interrupted") else []),
        "| T | clients | mode | tok/s | speed-up | acc. rate | acc. length | a | c | S(K) | efficiency "
        "| S(K) at measured verify | efficiency at measured verify "
        "| TTFT p50 ms | ITL p50 ms | ITL p99 ms | greedy = target-only | errors |"
        + (" pipeline hits |" if piped else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if piped else ""),
    ]
    for r in records:
        lines.append(
            "| "
            + " | ".join(
                [
                    _fmt(r["temperature"], 1),
                    str(r["concurrency"]),
                    f"`{_row_name(r)}`",
                    _fmt(r["tokens_per_s"], 1),
                    _fmt(r["speedup"], 2, "x"),
                    _fmt(r["acceptance_rate"], 3),
                    _fmt(r["acceptance_length"]),
                    _fmt(r["alpha"], 3),
                    _fmt(r["cost_ratio"], 3),
                    _fmt(r["theoretical_speedup"], 2, "x"),
                    _fmt(r["efficiency"]),
                    _fmt(r.get("theoretical_speedup_measured_verify"), 2, "x"),
                    _fmt(r.get("efficiency_measured_verify")),
                    _fmt(r["ttft_ms_p50"], 1),
                    _fmt(r["itl_ms_p50"], 1),
                    _fmt(r["itl_ms_p99"], 1),
                    _fmt(r["greedy_identical"]),
                    str(r["errors"]),
                    *([_fmt(r.get("pipeline_hit_rate"))] if piped else []),
                ]
            )
            + " |"
        )
    fallback = [r for r in records if r.get("target_only_rounds")]
    for r in fallback:
        lines += [
            "",
            f"Note: `{_row_name(r)}` at T={r['temperature']:g}, {r['concurrency']} client(s) ran "
            f"{r['target_only_rounds']} rounds without draft tokens (the drafter proposed nothing, e.g. an "
            "n-gram drafter without a match, or the draft was unavailable, slow or incompatible): its "
            "numbers mix in target-only decoding.",
        ]
    spec = [r for r in records if r["acceptance_per_position"]]
    if spec:
        width = max(len(r["acceptance_per_position"]) for r in spec)
        lines += [
            "",
            "Acceptance per draft position (rounds whose i-th draft token was accepted / rounds that drafted):",
            "",
            "| T | clients | mode | " + " | ".join(str(i + 1) for i in range(width)) + " |",
            "|---|---|---|" + "---|" * width,
        ]
        for r in spec:
            cells = [_fmt(x) for x in r["acceptance_per_position"]] + [""] * (width - len(r["acceptance_per_position"]))
            lines.append(
                f"| {_fmt(r['temperature'], 1)} | {r['concurrency']} | `{_row_name(r)}` | " + " | ".join(cells) + " |"
            )
    temps = list(dict.fromkeys(r["temperature"] for r in records))
    for t in temps:
        cols, rows = concurrency_table(records, t)
        if len(cols) > 1:
            lines += [
                "",
                f"Tokens/s against concurrent clients (T={t:g}):",
                "",
                "| mode | " + " | ".join(str(c) for c in cols) + " |",
                "|---|" + "---|" * len(cols),
            ]
            for name, by_c in rows:
                lines.append(f"| `{name}` | " + " | ".join(_fmt(by_c.get(c), 1) for c in cols) + " |")
    gains = meta.get("batching_gains") or []
    if gains:
        lines += [
            "",
            "Batching: tokens/s with batched forward passes / the same services with --max-batch 1:",
            "",
            "| T | clients | mode | batched tok/s | unbatched tok/s | gain |",
            "|---|---|---|---|---|---|",
        ]
        for g in gains:
            lines.append(
                f"| {_fmt(g['temperature'], 1)} | {g['concurrency']} | `{g['mode']}` | "
                f"{_fmt(g['batched_tokens_per_s'], 1)} | {_fmt(g['unbatched_tokens_per_s'], 1)} | "
                f"{_fmt(g['gain'], 2, 'x')} |"
            )
    tro = meta.get("tracing_overhead")
    if tro:
        lines += [
            "",
            f"Tracing overhead (`{tro['mode']}`, T=0, 1 client, {tro['requests_per_variant']} requests each, "
            f"interleaved; {tro['spans_received']} spans received by the OTLP sink): traced "
            f"{_fmt(tro['tokens_per_s_on'], 2)} tok/s vs untraced {_fmt(tro['tokens_per_s_off'], 2)} tok/s, "
            f"**{_fmt(tro['overhead_pct'], 2)}% fewer tokens/s** with 100% sampling.",
        ]
    cost = meta.get("cost") or {}
    if cost.get("service"):
        c = cost["service"]
        verify = ", ".join(f"K={k}: {v:.2f} ms" for k, v in c["target_verify_ms"].items())
        lines += [
            "",
            f"Cost (in-process, median of {c['samples']}): target {c['target_ms']:.2f} ms per 1-token "
            f"forward ({c['target_threads']} threads), draft {c['draft_ms']:.2f} ms per token "
            f"({c['draft_threads']} threads), **c = {c['c']:.3f}**; target verify over K+1 tokens: {verify}.",
        ]
    if cost.get("hf"):
        c = cost["hf"]
        lines += [f"Peer cost ({c['target_threads']} threads for both): c = {c['c']:.3f}."]
    rss = meta.get("peak_rss_mb") or {}
    if rss:
        lines += ["", "Peak RSS (VmHWM): " + ", ".join(f"{k} {_fmt(v, 0, ' MB')}" for k, v in rss.items()) + "."]
    corr = meta.get("correctness") or {}
    if corr.get("reference"):
        verdict = "identical" if corr["identical"] else "**NOT identical**"
        peer = "" if corr.get("peer_identical") in (None, True) else " The peer's output differs (reported, not ours)."
        lines += [
            "",
            f"Greedy check: every specd mode's temperature-0 output is {verdict} to "
            f"{corr['reference']} ({corr['records_checked']} records checked).{peer}",
        ]
    lines += [
        "",
        "Definitions: docs/bench.md. tok/s = completion tokens of the cell / its wall time; speed-up = "
        "tok/s / target-only's in the same (T, clients) cell; a = per-token acceptance; S(K) = "
        "(1 - a^(K+1)) / ((1 - a)(K c + 1)); efficiency = speed-up / S(K); 'at measured verify' puts the "
        "measured cost of the target's K+1-token pass, v_K, in place of S(K)'s 1: "
        "(1 - a^(K+1)) / ((1 - a)(K c + v_K)).",
        "",
    ]
    return "\n".join(lines)


def write_plot(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Speed-up per mode (one bar per cell), acceptance per draft position, and, when the run
    has several concurrency levels, tokens/s against concurrent clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["concurrency"] for r in records})
    panels = 3 if len(levels) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8))
    ax1, ax2 = axes[0], axes[1]
    if panels == 3:
        t0 = min(r["temperature"] for r in records)
        cols, rows = concurrency_table(records, t0)
        for name, by_c in rows:
            xs = [c for c in cols if c in by_c]
            axes[2].plot(xs, [by_c[c] for c in xs], marker="o", label=name)
        axes[2].set_xscale("log", base=2)
        axes[2].set_xticks(cols)
        axes[2].set_xticklabels([str(c) for c in cols])
        axes[2].set_xlabel("concurrent clients")
        axes[2].set_ylabel("aggregate tokens/s")
        axes[2].set_title(f"Throughput against concurrency (T={t0:g})")
        axes[2].legend(fontsize=8)
    modes = [m for m in dict.fromkeys(_row_name(r) for r in records) if m != BASELINE]
    cells = list(dict.fromkeys((r["temperature"], r["concurrency"]) for r in records))
    width = 0.8 / max(1, len(cells))
    for j, (t, c) in enumerate(cells):
        values = []
        for m in modes:
            hit = next(
                (r for r in records if _row_name(r) == m and r["temperature"] == t and r["concurrency"] == c), None
            )
            values.append(hit["speedup"] if hit and hit["speedup"] is not None else math.nan)
        xs = [i + (j - (len(cells) - 1) / 2) * width for i in range(len(modes))]
        ax1.bar(xs, values, width, label=f"T={t:g}, {c} client{'s' if c > 1 else ''}")
    ax1.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax1.set_xticks(range(len(modes)))
    ax1.set_xticklabels(modes, rotation=30, ha="right")
    ax1.set_ylabel(f"speed-up over {BASELINE} (tokens/s ratio)")
    ax1.set_title("Speed-up per mode")
    ax1.legend(fontsize=8)
    low_c = min((c for _, c in cells), default=1)
    for r in records:
        if r["acceptance_per_position"] and r["concurrency"] == low_c:
            ys = r["acceptance_per_position"]
            ax2.plot(
                range(1, len(ys) + 1),
                ys,
                marker="o",
                linestyle="-" if r["temperature"] == 0 else "--",
                label=f"{_row_name(r)} T={r['temperature']:g}",
            )
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance (accepted / rounds that drafted)")
    ax2.set_ylim(0, 1.02)
    ax2.set_title(f"Acceptance per draft position ({low_c} client{'s' if low_c > 1 else ''})")
    if ax2.lines:
        ax2.legend(fontsize=8)
        ax2.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the run ------------------------------------------------------------------

FULL_DEFAULTS = dict(
    prompts=30, max_new_tokens=64, draft_lengths="4", temperatures="0,0.7", concurrency="1,8", cost_samples=30
)
QUICK_DEFAULTS = dict(
    prompts=6, max_new_tokens=32, draft_lengths="4", temperatures="0,0.7", concurrency="1,8", cost_samples=10
)


def _int_list(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of integers (got {text!r})") from None
    if not out or min(out) < 1:
        raise ValueError(f"{what} must list integers >= 1 (got {text!r})")
    return out


def _float_list(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of numbers (got {text!r})") from None
    if not out or min(out) < 0:
        raise ValueError(f"{what} must list numbers >= 0 (got {text!r})")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`specd bench` flags (no heavy imports: the CLI builds every parser at start)."""
    g = p.add_argument_group("services")
    g.add_argument("--target", default="demo", help="target model folder or 'demo' (default: demo)")
    g.add_argument("--draft", default="demo", help="draft model folder, 'demo' or 'ngram' (default: demo)")
    g.add_argument(
        "--address",
        default="",
        help="use running services at this coordinator HOST:PORT "
        "(--target/--draft then name the same models, for the tokenizer, c and the peer)",
    )
    g.add_argument("--cache-dir", default="", help="model cache (default: SPECD_CACHE_DIR or ~/.cache/specd)")
    g.add_argument("--target-threads", type=int, default=2, help="torch threads of the target service (default: 2)")
    g.add_argument("--draft-threads", type=int, default=1, help="torch threads of the draft service (default: 1)")
    g.add_argument(
        "--hf-threads",
        type=int,
        default=0,
        help="torch threads of the in-process peer and of the bench process (default: --target-threads)",
    )
    for svc in ("target", "draft", "coordinator"):
        g.add_argument(f"--{svc}-args", default="", help=f"extra flags for `specd serve {svc}` (one string)")
    g = p.add_argument_group("workload")
    g.add_argument(
        "--quick",
        action="store_true",
        help="small preset: 6 prompts, 32 tokens, K=4 (T 0 and 0.7, 1 and 8 clients); explicit flags still win",
    )
    g.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help="comma list: target-only, auto, fixed-K (bare 'fixed': "
        "every --draft-lengths K), hf-K / hf (the peer, K assistant tokens, constant), hf-default, "
        f"hf-target-only (default: {DEFAULT_MODES})",
    )
    g.add_argument(
        "--custom-mode",
        action="append",
        default=[],
        metavar="NAME:key=value,...",
        help="an extra service mode from request options, e.g. 'pipe-4:speculation=fixed,draft_length=4,"
        "pipeline=bonus' (repeatable)",
    )
    g.add_argument(
        "--draft-lengths", default=None, help="K values for fixed/pipelined/hf, e.g. 2,4,8 for a sweep (default: 4)"
    )
    g.add_argument("--temperatures", default=None, help="comma list (default: 0,0.7)")
    g.add_argument(
        "--concurrency", default=None, help="concurrent clients, comma list (default: 1,8); the peer runs at 1"
    )
    g.add_argument(
        "--prompts", type=int, default=None, help="prompts per cell, mixed over categories (default: 30; quick: 6)"
    )
    g.add_argument(
        "--prompt-file",
        default="",
        help="JSONL prompt set, or a shipped one by name: 'bench' (default: "
        "code, chat, prose) or 'edit' (repetition-heavy: edit the code in the prompt, for --draft ngram)",
    )
    g.add_argument("--categories", default="", help="only these categories, comma list (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (default: 64; quick: 32)")
    g.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="stop at end-of-sequence (default: generate exactly --max-new-tokens, for equal work in every mode)",
    )
    g.add_argument("--seed", type=int, default=0, help="request i gets seed + i (default: 0)")
    g.add_argument("--cost-samples", type=int, default=None, help="forwards timed per model for c (default: 30)")
    g.add_argument(
        "--no-inprocess",
        action="store_true",
        help="skip everything that loads the models in this "
        "process: the peer and the measured c (S(K) then stays empty)",
    )
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    g.add_argument(
        "--batching",
        choices=sorted(BATCHING_SETUPS),
        default="on",
        help="'both' runs every cell twice, on services with batched forward passes and on the same "
        "services with --max-batch 1, and reports the gain; 'off' only the latter (default: on)",
    )
    g.add_argument(
        "--tracing-overhead",
        action="store_true",
        help="also measure tracing's cost: services trace 100%% of requests to an OTLP receiver in "
        "this process; traced and untraced requests alternate (see docs/bench.md)",
    )
    g.add_argument(
        "--tracing-mode",
        default="",
        help="mode for --tracing-overhead (default: the first speculative service mode, else target-only)",
    )
    g.add_argument(
        "--tracing-repeats",
        type=int,
        default=2,
        help="passes over the prompts per variant for --tracing-overhead (default: 2)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", default="", help="JSON report (default: bench-results/bench.json)")
    g.add_argument("--markdown", default="", help="markdown table (default: next to the JSON, .md)")
    g.add_argument("--plot", default="", help="PNG plot (default: next to the JSON, .png)")
    g.add_argument("--save-outputs", action="store_true", help="include every request's token IDs in the JSON")
    g.add_argument(
        "--interleave",
        type=int,
        default=1,
        help="modes take turns over N slices of the prompts (each of at least `clients` prompts), so a "
        "shared machine's drifts hit every mode alike (default: 1, each mode runs the whole set)",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 if a specd mode's greedy output differs from target-only's or a request failed",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--verbose", action="store_true", help="relay the services' log lines")


@dataclass
class _Plan:
    modes: list[Mode]
    temperatures: list[float]
    concurrency: list[int]
    draft_lengths: list[int]
    prompts: list[BenchPrompt]
    max_new_tokens: int
    cost_samples: int
    hf_threads: int


def _plan(args: argparse.Namespace) -> _Plan:
    preset = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return preset[name] if value is None else value

    draft_lengths = _int_list(pick("draft_lengths"), "--draft-lengths")
    modes = cap_adaptive_modes(parse_modes(args.modes, draft_lengths, args.custom_mode), draft_lengths)
    if args.no_inprocess or args.draft == "ngram":
        modes = [m for m in modes if not m.peer or (not m.request.get("assistant", True) and not args.no_inprocess)]
    prompts_n, max_new = int(pick("prompts")), int(pick("max_new_tokens"))
    if prompts_n < 1 or max_new < 1:
        raise ValueError("--prompts and --max-new-tokens must be >= 1")
    if args.interleave < 1:
        raise ValueError(f"--interleave must be >= 1 (got {args.interleave})")
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    prompts = select_prompts(load_prompts(args.prompt_file or None), prompts_n, categories)
    if not prompts:
        raise ValueError(f"no prompts match --categories {args.categories!r}")
    return _Plan(
        modes,
        _float_list(pick("temperatures"), "--temperatures"),
        _int_list(pick("concurrency"), "--concurrency"),
        draft_lengths,
        prompts,
        max_new,
        max(1, int(pick("cost_samples"))),
        args.hf_threads or args.target_threads,
    )


def _output_paths(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    json_path = Path(args.json) if args.json else Path("bench-results") / "bench.json"
    md = Path(args.markdown) if args.markdown else json_path.with_suffix(".md")
    png = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    return json_path, md, png


def _progress(total: int, desc: str, disable: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=disable, file=sys.stderr, dynamic_ncols=True)


def _run_service_cell(
    address: str,
    mode: Mode,
    items: Sequence[tuple[BenchPrompt, list[int]]],
    *,
    temperature: float,
    concurrency: int,
    max_new_tokens: int,
    seed: int,
    ignore_eos: bool,
    timeout: float,
    bar: Any,
    metadata: Callable[[], Sequence[tuple[str, str]]] = lambda: (),
) -> tuple[list[RequestResult], float]:
    from coordinator.client import CoordinatorClient

    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=ignore_eos, **mode.request)
    local = threading.local()
    clients: list[Any] = []
    lock = threading.Lock()

    def one(i: int) -> RequestResult:
        if not hasattr(local, "client"):  # one channel per client thread, as separate clients would have
            local.client = CoordinatorClient(address, timeout=timeout)
            with lock:
                clients.append(local.client)
        p, ids = items[i]
        r = run_service_request(local.client, p.id, ids, dict(options, seed=seed + i), metadata())
        bar.update(1)
        return r

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench-client")
    try:
        start = time.perf_counter()
        results = list(pool.map(one, range(len(items))))
        wall = time.perf_counter() - start
    finally:
        with lock:
            for c in clients:
                c.close()  # on an interrupt this cancels the streams in flight, so the pool ends at once
        pool.shutdown(wait=True, cancel_futures=True)
    return results, wall


def _load_inprocess(target_dir: Path, draft_dir: Path | None) -> tuple[Any, Any]:
    from transformers.utils import logging as hf_logging

    from specd.core.models import load_pretrained

    hf_logging.set_verbosity_error()  # the peer's per-call notices would drown the progress bars
    target = load_pretrained(target_dir)
    draft = None
    if draft_dir is not None:
        draft = load_pretrained(draft_dir)
        try:
            from specd.tools.distill import install_reduced_head
        except ImportError:  # a specd without reduced heads
            pass
        else:
            install_reduced_head(draft.model, draft_dir)  # as the draft service does (full-width logits either way)
    return target, draft


class BenchError(Exception):
    """A problem with the run's set-up (reported in one line, exit status 2)."""


def run(args: argparse.Namespace) -> int:
    """`specd bench`: returns the exit status (0; 1 with --strict when a check failed; 2 bad set-up; 130 interrupted)."""
    t_run = time.perf_counter()
    try:
        plan = _plan(args)
    except (ValueError, OSError) as exc:
        print(f"specd bench: {exc}", file=sys.stderr)
        return 2
    json_path, md_path, png_path = _output_paths(args)
    phases: dict[str, float] = {}
    mark = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = now - mark
        mark = now

    restore_sigterm = _sigterm_as_interrupt()
    try:
        return _run(args, plan, json_path, md_path, png_path, t_run, phases, phase)
    finally:
        restore_sigterm()


def _sigterm_as_interrupt() -> Callable[[], None]:
    """SIGTERM raises KeyboardInterrupt (so the services get stopped and a partial report written); returns undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _run(
    args: argparse.Namespace,
    plan: _Plan,
    json_path: Path,
    md_path: Path,
    png_path: Path,
    t_run: float,
    phases: dict[str, float],
    phase: Callable[[str], None],
) -> int:
    from transformers import AutoTokenizer

    from specd.core import catalog
    from specd.core.catalog import NGRAM
    from specd.serving.config import default_cache_dir

    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    target_dir = catalog.target_folder(args.target, cache)
    draft_dir: Path | None = None if args.draft == NGRAM else catalog.draft_folder(args.draft, args.target, cache)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    k_max = largest_k(plan.modes, plan.draft_lengths)
    quiet = args.no_progress
    interrupted = False
    records: list[dict[str, Any]] = []
    outputs: dict[tuple[str, str, float, int], dict[str, list[int]]] = {}
    cost: dict[str, Any] = {}
    peak: dict[str, Any] = {}

    setups = BATCHING_SETUPS[args.batching]
    if args.address and len(setups) > 1:
        print("specd bench: --batching both starts its own services; drop --address", file=sys.stderr)
        return 2
    receiver = None
    tracing_args: list[str] = []
    if args.tracing_overhead:
        if args.address:
            print("specd bench: --tracing-overhead starts its own services; drop --address", file=sys.stderr)
            return 2
        from specd.tools.otlp_receiver import OtlpReceiver

        receiver = OtlpReceiver(keep=False)
        tracing_args = ["--otlp-endpoint", receiver.endpoint, "--trace-sample-ratio", "1"]
    # With tracing on, the ordinary cells opt out per request, so they cost what they cost without it.
    cell_metadata = untraced_metadata if receiver is not None else (lambda: ())
    items: list[tuple[BenchPrompt, list[int]]] = []
    peer: HFPeer | None = None
    tracing_result: dict[str, Any] | None = None
    try:
        for index, setup in enumerate(setups):
            cluster = None
            label = f" [{setup.label}]" if setup.label else ""
            if not args.address:
                from specd.tools.localcluster import LocalCluster

                _say(
                    f"starting target, draft and coordinator{label} ({target_dir.name}, "
                    f"{draft_dir.name if draft_dir else args.draft}) ...",
                    quiet,
                )
                extra = [*setup.model_service_args, *tracing_args]
                cluster = LocalCluster(
                    target_dir,
                    draft_dir if draft_dir is not None else NGRAM,
                    cache_dir=cache,
                    target_threads=args.target_threads,
                    draft_threads=args.draft_threads,
                    coordinator_threads=1,
                    target_args=[*extra, *shlex.split(args.target_args)],
                    draft_args=["--max-draft-tokens", str(max(32, k_max)), *extra, *shlex.split(args.draft_args)],
                    coordinator_args=[
                        "--max-draft-length",
                        str(max(16, k_max)),
                        *tracing_args,
                        *shlex.split(args.coordinator_args),
                    ],
                    ready_timeout_s=600.0,
                    echo=args.verbose,
                )
                try:
                    cluster.start()
                except RuntimeError as exc:
                    print(f"specd bench: {exc}\n{cluster.logs()}", file=sys.stderr)
                    return 2
                address = cluster.address
            else:
                address = args.address
            phase(f"start_services{setup.label and '_' + setup.label}_s")
            try:
                if not items:
                    items, peer = _first_setup(
                        args, plan, address, tokenizer, target_dir, draft_dir, cost, quiet, phase
                    )
                modes = [m for m in plan.modes if not m.peer or (peer is not None and index == 0)]
                _warm_up(args, plan, modes, items, address, peer if index == 0 else None, quiet, cell_metadata)
                phase(f"warmup{setup.label and '_' + setup.label}_s")
                try:
                    _run_cells(
                        args,
                        plan,
                        modes,
                        items,
                        address,
                        peer if index == 0 else None,
                        cost,
                        records,
                        outputs,
                        quiet,
                        setup.label,
                        cell_metadata,
                    )
                    if receiver is not None and index == 0:
                        tracing_result = _tracing_cell(args, plan, modes, items, address, receiver, quiet)
                except KeyboardInterrupt:
                    interrupted = True
                    print(
                        f"specd bench: interrupted; stopping the services and writing the {len(records)} "
                        "records so far",
                        file=sys.stderr,
                        flush=True,
                    )
                phase(f"cells{setup.label and '_' + setup.label}_s")
                if cluster is not None:
                    rss = {k: (v / 2**20 if v is not None else None) for k, v in cluster.peak_rss_bytes().items()}
                    peak.update({f"{k}{label}": v for k, v in rss.items()})
            except BenchError as exc:
                print(f"specd bench: {exc}", file=sys.stderr)
                return 2
            except KeyboardInterrupt:
                if not records:
                    print("specd bench: interrupted before the first cell; nothing to report", file=sys.stderr)
                    return 130
                interrupted = True
            except Exception:
                if cluster is not None:
                    print(cluster.logs(), file=sys.stderr)
                raise
            finally:
                if cluster is not None:
                    cluster.stop()
            if interrupted:
                break
    finally:
        if receiver is not None:
            receiver.stop()  # after the services stopped: they flush their last spans on the way out
            if tracing_result is not None:
                tracing_result["spans_received"] = receiver.span_count
    from specd.tools.localcluster import peak_rss_of

    bench_rss = peak_rss_of(os.getpid())
    peak["bench"] = bench_rss / 2**20 if bench_rss is not None else None

    phase("stop_services_s")
    correctness = finish_records(records, outputs)
    meta = _meta(
        args,
        plan,
        target_dir,
        draft_dir,
        address,
        cluster is not None,
        cost,
        peak,
        correctness,
        time.perf_counter() - t_run,
    )
    meta["phases_s"] = phases
    meta["interrupted"] = interrupted
    meta["batching_gains"] = batching_gains(records)
    meta["tracing_overhead"] = tracing_result
    report = {"meta": meta, "records": records}
    for path in (json_path, md_path, png_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, default=float) + "\n", encoding="utf-8")
    markdown = render_markdown(report)
    md_path.write_text(markdown, encoding="utf-8")
    write_plot(records, png_path)
    print(markdown)
    print(f"wrote {json_path}, {md_path}, {png_path}", file=sys.stderr)
    if interrupted:
        return 130
    failed = correctness["identical"] is False or any(r["errors"] for r in records if not r["runner"] == RUNNER_HF)
    if correctness["identical"] is False:
        print(f"specd bench: greedy output differs from {BASELINE}: {correctness['failures']}", file=sys.stderr)
    return 1 if args.strict and failed else 0


def _first_setup(
    args: argparse.Namespace,
    plan: _Plan,
    address: str,
    tokenizer: Any,
    target_dir: Path,
    draft_dir: Path | None,
    cost: dict[str, Any],
    quiet: bool,
    phase: Callable[[str], None],
) -> tuple[list[tuple[BenchPrompt, list[int]]], HFPeer | None]:
    """Once per run: the prompts as token IDs (fitted to the context), c and the in-process peer."""
    from coordinator.client import CoordinatorClient
    from specd.core.catalog import NGRAM

    try:
        with CoordinatorClient(address, timeout=min(args.timeout, 30.0)) as client:
            max_context = int(client.model_info().max_context) or 1 << 30
    except Exception as exc:
        raise BenchError(f"cannot reach the coordinator at {address}: {exc}") from exc
    room = max(1, max_context - plan.max_new_tokens)
    items = [(p, tokenize_prompt(tokenizer, p)[-room:]) for p in plan.prompts]
    peer: HFPeer | None = None
    if not args.no_inprocess:
        _say("loading the models in-process (the peer and the cost ratio c) ...", quiet)
        target_m, draft_m = _load_inprocess(target_dir, draft_dir)
        phase("load_inprocess_s")
        probe = items[0][1]
        # every K some mode drafts with (fixed-6 among default lengths 2, 4), for its S(K) at the measured verify
        verify_ks = sorted({m.draft_length for m in plan.modes if m.draft_length} | set(plan.draft_lengths))
        if draft_m is not None or args.draft == NGRAM:
            cost["service"] = measure_cost(
                target_m.model,
                draft_m.model if draft_m else None,
                probe,
                target_threads=args.target_threads,
                draft_threads=args.draft_threads,
                samples=plan.cost_samples,
                draft_lengths=verify_ks,
            )
            if draft_m is not None and any(m.peer for m in plan.modes):
                same = plan.hf_threads == args.target_threads == args.draft_threads
                cost["hf"] = (
                    cost["service"]
                    if same
                    else measure_cost(
                        target_m.model,
                        draft_m.model,
                        probe,
                        target_threads=plan.hf_threads,
                        draft_threads=plan.hf_threads,
                        samples=plan.cost_samples,
                        draft_lengths=verify_ks,
                    )
                )
        if any(m.peer for m in plan.modes):
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
            peer = HFPeer(target_m.model, draft_m.model if draft_m else None, threads=plan.hf_threads, pad_token_id=pad)
    phase("measure_cost_s")
    return items, peer


def _warm_up(
    args: argparse.Namespace,
    plan: _Plan,
    modes: Sequence[Mode],
    items: Sequence[tuple[BenchPrompt, list[int]]],
    address: str,
    peer: HFPeer | None,
    quiet: bool,
    metadata: Callable[[], Sequence[tuple[str, str]]] = lambda: (),
) -> None:
    """Every mode once, short, not measured."""
    from coordinator.client import CoordinatorClient

    _say("warming up ...", quiet)
    with CoordinatorClient(address, timeout=args.timeout) as client:
        for m in modes:
            if not m.peer:
                r = run_service_request(
                    client,
                    "warmup",
                    items[0][1],
                    dict(max_new_tokens=min(8, plan.max_new_tokens), temperature=0.0, ignore_eos=True, **m.request),
                    metadata(),
                )
                if r.error:
                    raise BenchError(f"mode {m.name} fails on its warm-up request: {r.error}")
    if peer is not None:
        for m in modes:
            if m.peer:
                peer.configure(m)
                peer.run("warmup", items[0][1], m, temperature=0.0, seed=0, max_new_tokens=4, stop_at_eos=False)


def _tracing_cell(
    args: argparse.Namespace,
    plan: _Plan,
    modes: Sequence[Mode],
    items: Sequence[tuple[BenchPrompt, list[int]]],
    address: str,
    receiver: Any,
    quiet: bool,
) -> dict[str, Any]:
    service_modes = [m for m in modes if not m.peer]
    if args.tracing_mode:
        chosen = next((m for m in service_modes if m.name == args.tracing_mode), None)
        if chosen is None:
            raise BenchError(
                f"--tracing-mode {args.tracing_mode!r} is not one of this run's modes "
                f"({', '.join(m.name for m in service_modes)})"
            )
    else:
        chosen = next((m for m in service_modes if not m.baseline), service_modes[0])
    repeats = max(1, args.tracing_repeats)
    with _progress(2 * repeats * len(items), f"tracing off/on {chosen.name}", quiet) as bar:
        return measure_tracing_overhead(
            address,
            chosen,
            items,
            repeats=repeats,
            max_new_tokens=plan.max_new_tokens,
            seed=args.seed,
            ignore_eos=not args.stop_at_eos,
            timeout=args.timeout,
            spans=lambda: receiver.span_count,
            bar=bar,
        )


def interleave_slices(n_items: int, concurrency: int, requested: int) -> list[range]:
    """Contiguous slices of the prompt set that every mode runs in turn (one slice: the whole set).

    A slice keeps at least `concurrency` prompts, so interleaving never leaves clients idle by design.
    """
    n = max(1, min(requested, n_items // max(1, concurrency)))
    bounds = [round(i * n_items / n) for i in range(n + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _run_cells(
    args: argparse.Namespace,
    plan: _Plan,
    modes: Sequence[Mode],
    items: Sequence[tuple[BenchPrompt, list[int]]],
    address: str,
    peer: HFPeer | None,
    cost: Mapping[str, Any],
    records: list[dict[str, Any]],
    outputs: dict[tuple[str, str, float, int], dict[str, list[int]]],
    quiet: bool,
    services: str = "",
    metadata: Callable[[], Sequence[tuple[str, str]]] = lambda: (),
) -> None:
    """Every (temperature, concurrency, mode) cell, appending to records / outputs as each (T, clients) cell finishes.

    With --interleave N the modes take turns over N slices of the prompts, so slow drifts of a
    shared machine's speed hit every mode alike; a mode's wall time is the sum over its slices.
    """
    for temperature in plan.temperatures:
        for concurrency in plan.concurrency:
            cell_modes = [m for m in modes if not m.peer or concurrency == 1]  # the peer serves one sequence at a time
            slices = interleave_slices(len(items), concurrency, args.interleave)
            results: dict[str, list[RequestResult]] = {m.name: [] for m in cell_modes}
            walls = dict.fromkeys(results, 0.0)
            for part, rows in enumerate(slices):
                for m in cell_modes:
                    chunk = [items[i] for i in rows]
                    where = f" {part + 1}/{len(slices)}" if len(slices) > 1 else ""
                    desc = f"T={temperature:g} c={concurrency} {m.name}{f' [{services}]' if services else ''}{where}"
                    with _progress(len(chunk), desc, quiet) as bar:
                        if m.peer:
                            assert peer is not None
                            peer.configure(m)
                            start = time.perf_counter()
                            got = []
                            for i, (p, ids) in zip(rows, chunk):
                                got.append(
                                    peer.run(
                                        p.id,
                                        ids,
                                        m,
                                        temperature=temperature,
                                        seed=args.seed + i,
                                        max_new_tokens=plan.max_new_tokens,
                                        stop_at_eos=args.stop_at_eos,
                                    )
                                )
                                bar.update(1)
                            wall = time.perf_counter() - start
                        else:
                            got, wall = _run_service_cell(
                                address,
                                m,
                                chunk,
                                temperature=temperature,
                                concurrency=concurrency,
                                max_new_tokens=plan.max_new_tokens,
                                seed=args.seed + rows.start,
                                ignore_eos=not args.stop_at_eos,
                                timeout=args.timeout,
                                bar=bar,
                                metadata=metadata,
                            )
                        bar.set_postfix_str(
                            f"{sum(len(r.token_ids) for r in got if r.error is None) / wall:.1f} tok/s"
                            if wall > 0
                            else ""
                        )
                    results[m.name] += got
                    walls[m.name] += wall
            for m in cell_modes:
                rec = summarize(
                    m,
                    temperature,
                    concurrency,
                    results[m.name],
                    walls[m.name],
                    max_new_tokens=plan.max_new_tokens,
                    cost=cost.get("hf" if m.peer else "service"),
                )
                rec["services"] = services
                rec["interleave_slices"] = len(slices)
                outputs[(services, m.name, temperature, concurrency)] = {
                    r.prompt_id: r.token_ids for r in results[m.name] if r.error is None
                }
                if args.save_outputs:
                    rec["outputs"] = {r.prompt_id: r.token_ids for r in results[m.name]}
                records.append(rec)


def _say(text: str, quiet: bool) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


def _meta(
    args: argparse.Namespace,
    plan: _Plan,
    target_dir: Path,
    draft_dir: Path | None,
    address: str,
    started: bool,
    cost: dict[str, Any],
    peak: dict[str, Any],
    correctness: dict[str, Any],
    duration_s: float,
) -> dict[str, Any]:
    import torch
    import transformers

    categories = list(dict.fromkeys(p.category for p in plan.prompts))
    return {
        "tool": "specd bench",
        "arguments": {k: v for k, v in vars(args).items() if not callable(v)},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": duration_s,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "models": {"target": str(target_dir), "draft": str(draft_dir) if draft_dir else args.draft},
        "address": address,
        "services_started": started,
        "settings": {
            "modes": [m.name for m in plan.modes],
            "temperatures": plan.temperatures,
            "concurrency": plan.concurrency,
            "draft_lengths": plan.draft_lengths,
            "prompts": len(plan.prompts),
            "prompt_ids": [p.id for p in plan.prompts],
            "categories": categories,
            "max_new_tokens": plan.max_new_tokens,
            "stop_at_eos": args.stop_at_eos,
            "seed": args.seed,
            "target_threads": args.target_threads,
            "draft_threads": args.draft_threads,
            "hf_threads": plan.hf_threads,
            "quick": args.quick,
            "interleave": args.interleave,
        },
        "cost": cost,
        "peak_rss_mb": peak,
        "correctness": correctness,
    }
