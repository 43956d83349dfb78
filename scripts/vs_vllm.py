#!/usr/bin/env python
"""specd beside vLLM on the same model, the same machine and one load generator (issue 33).

Starts vLLM's CPU build (`vllm serve`, from the venv `scripts/peer-vllm.sh` made) and
`specd up` (its OpenAI HTTP port), both on 127.0.0.1 and the demo target folder, then
drives both with `vllm bench serve` (the OpenAI completions endpoint, the chat template
applied client-side, the same prompts) cell by cell, the systems interleaved within each
cell: for each prompt set, temperature and client count, vLLM target-only, specd
target-only (`speculation: off`), specd's speculation (its default draft and auto), and
vLLM's n-gram speculation when `--vllm-ngram` is given (a second vLLM server, started
after the first is stopped). Writes every cell's numbers as JSON and a markdown table.

    .venv/bin/python scripts/vs_vllm.py --out docs/results/vs-vllm
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SETS = {"general": "bench.jsonl", "edit": "edit.jsonl", "repetitive": "repetitive.jsonl"}
CACHE = Path(os.environ.get("SPECD_CACHE_DIR") or Path.home() / ".cache" / "specd")
MODEL_DIR = CACHE / "smollm2-135m-instruct"


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:  # loopback only
                return json.loads(r.read() or b"{}")
        except (OSError, ValueError):
            time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def _dataset(name: str, n: int, out: Path) -> Path:
    """The first n prompts of a specd prompt set as a `vllm bench serve` custom dataset."""
    path = out / f"prompts-{name}.jsonl"
    rows = [json.loads(line) for line in (ROOT / "specd" / "prompts" / SETS[name]).read_text().splitlines() if line]
    path.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows[:n]))
    return path


def _bench(vllm: Path, base_url: str, model: str, data: Path, args: argparse.Namespace, **cell: Any) -> dict[str, Any]:
    """One `vllm bench serve` run; its saved result."""
    result = args.out / "runs" / f"{cell['name']}.json"
    cmd = [
        str(vllm),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        str(MODEL_DIR),
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(data),
        "--disable-shuffle",
        "--num-prompts",
        str(args.prompts),
        "--custom-output-len",
        str(args.max_tokens),
        "--ignore-eos",
        "--max-concurrency",
        str(cell["clients"]),
        "--temperature",
        str(cell["temperature"]),
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
        "--disable-tqdm",
    ]
    if cell.get("extra_body"):
        cmd += ["--extra-body", json.dumps(cell["extra_body"])]
    print(f"vs_vllm: {cell['name']}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    return {
        **{k: v for k, v in cell.items() if k != "name"},
        "command": " ".join(cmd),
        **json.loads(result.read_text()),
    }


def _start_vllm(venv: Path, port: int, spec: dict[str, Any] | None, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(MODEL_DIR),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "smollm2-135m-instruct",
        "--dtype",
        "float32",
        "--max-model-len",
        "8192",
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
    ]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="auto")
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _row(r: dict[str, Any], base: dict[tuple[str, str, float, int], float]) -> str:
    tps = r.get("output_throughput", 0.0)
    own = base.get((r["system"], r["set"], r["temperature"], r["clients"]), 0.0)
    speedup = f"{tps / own:.2f}x" if own else "–"
    return (
        f"| {r['set']} | {r['temperature']:g} | {r['clients']} | {r['system']} | {r['mode']} | {tps:.1f} | {speedup} "
        f"| {r.get('p50_ttft_ms', 0):.0f} | {r.get('p99_ttft_ms', 0):.0f} "
        f"| {r.get('p50_itl_ms', 0):.1f} | {r.get('p99_itl_ms', 0):.1f} | {r.get('failed', 0)} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("SPECD_VLLM_VENV", "/work/vllm-venv")))
    ap.add_argument("--out", type=Path, default=Path("bench-results/vs-vllm"))
    ap.add_argument("--sets", default="general,repetitive")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per cell")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vllm-ngram", action="store_true", help="also run vLLM's n-gram speculation (a second server)")
    args = ap.parse_args()
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    vllm_bin = args.vllm_venv / "bin" / "vllm"
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    vllm_port, specd_port = 8100, 8000
    cells = [
        (s, float(t), int(c))
        for s in args.sets.split(",")
        for t in args.temperatures.split(",")
        for c in args.clients.split(",")
    ]
    results: list[dict[str, Any]] = []
    vllm = _start_vllm(args.vllm_venv, vllm_port, None, logs / "vllm.log")
    specd = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "specd"), "up", "--http-port", str(specd_port), "--no-restart"],
        stdout=(logs / "specd.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{vllm_port}/v1/models", 600, vllm)
        models = _wait_http(f"http://127.0.0.1:{specd_port}/v1/models", 600, specd)
        specd_model = models["data"][0]["id"]
        for s, t, c in cells:
            data = _dataset(s, args.prompts, args.out)
            tag = f"{s}-T{t:g}-c{c}"
            common = dict(set=s, temperature=t, clients=c)
            for system, mode, url, model, extra in (
                ("vllm", "target-only", vllm_port, "smollm2-135m-instruct", None),
                ("specd", "target-only", specd_port, specd_model, {"speculation": "off"}),
                ("specd", "suffix auto", specd_port, specd_model, None),
            ):
                name = f"{tag}-{system}-{mode.replace(' ', '-')}"
                results.append(
                    _bench(
                        vllm_bin,
                        f"http://127.0.0.1:{url}",
                        model,
                        data,
                        args,
                        name=name,
                        system=system,
                        mode=mode,
                        extra_body=extra,
                        **common,
                    )
                )
        if args.vllm_ngram:
            _stop(vllm)
            spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
            vllm = _start_vllm(args.vllm_venv, vllm_port, spec, logs / "vllm-ngram.log")
            try:
                _wait_http(f"http://127.0.0.1:{vllm_port}/v1/models", 600, vllm)
            except RuntimeError as exc:
                tail = (logs / "vllm-ngram.log").read_text(errors="replace").splitlines()[-15:]
                results.append({"system": "vllm", "mode": "ngram", "error": str(exc), "log_tail": tail})
            else:
                for s, t, c in cells:
                    data = _dataset(s, args.prompts, args.out)
                    name = f"{s}-T{t:g}-c{c}-vllm-ngram"
                    results.append(
                        _bench(
                            vllm_bin,
                            f"http://127.0.0.1:{vllm_port}",
                            "smollm2-135m-instruct",
                            data,
                            args,
                            name=name,
                            system="vllm",
                            mode="ngram",
                            set=s,
                            temperature=t,
                            clients=c,
                        )
                    )
    finally:
        _stop(specd)
        _stop(vllm)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    ok = [r for r in results if "error" not in r]
    base = {
        (r["system"], r["set"], r["temperature"], r["clients"]): r["output_throughput"]
        for r in ok
        if r["mode"] == "target-only"
    }
    lines = [
        "| set | T | clients | system | mode | output tok/s | vs own target-only | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | ITL p99 ms | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_row(r, base) for r in ok),
    ]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for r in results:
        if "error" in r:
            print(f"vs_vllm: {r['system']} {r['mode']} failed: {r['error']}\n" + "\n".join(r["log_tail"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
