"""The measuring steps of scripts/gpu_check.sh (docs/gpu.md).

    python -m specd.tools.gpu_check measure --work DIR [--dry-run]      verify-cost curves, decode steps
    python -m specd.tools.gpu_check distill-target --folder DIR [--dry-run]
    python -m specd.tools.gpu_check summary --work DIR --out DIR [--dry-run]

`measure` builds each random-weight model on the spot (8B shape as the target, 1B shape as the
draft; bf16 on CUDA), times specd's runner and transformers' generate on it, frees it, and writes
WORK/measure.json. `summary` merges that, the test results and the distill run into
OUT/summary.json and writes the fitted profile OUT/h200-measured.json. --dry-run: the same steps
on the CPU, on tiny stand-ins of each shape, in seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch
import transformers

from specd.core.model.runner import CausalLMRunner
from specd.core.model.sim.cost import CostModel
from specd.tools.gpu_check.decode_compare import NO_COMPILED_PATH, generate_step_ms, runner_step_ms
from specd.tools.gpu_check.profile_fit import fit_cost_model, profile_json, write_json
from specd.tools.gpu_check.shapes import (
    DEMO_TARGET,
    LLAMA_1B,
    LLAMA_8B,
    Shape,
    build_llama,
    dry_run_stand_in,
    save_random_target,
)
from specd.tools.gpu_check.verify_curve import CurvePoint, curve_ratios, measure_curve

NEWS = (1, 2, 4, 8, 16, 32, 64)  # n: new tokens per session (K + 1 of a verify)
BATCHES = (1, 8, 32)
ROLES = (("target", LLAMA_8B), ("draft", LLAMA_1B))


def _device(dry_run: bool) -> torch.device:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA device (use --dry-run on a CPU)")
    return torch.device("cuda")


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"1x {torch.cuda.get_device_name(device)}"
    return f"{platform.machine()} CPU (dry run, tiny stand-in models)"


def _shape(role_shape: Shape, dry_run: bool) -> Shape:
    return dry_run_stand_in(role_shape) if dry_run else role_shape


def measure_role(shape: Shape, device: torch.device, dry_run: bool) -> dict[str, Any]:
    """Curve (two contexts) and decode steps of one random-weight model; the model is freed after."""
    context = 32 if dry_run else 512
    samples = 2 if dry_run else 8
    dtype = torch.float32 if dry_run else torch.bfloat16
    model = build_llama(shape, dtype, device)
    runner = CausalLMRunner(model, max_context=4 * context + max(NEWS) + 8)
    points = measure_curve(runner, list(NEWS), list(BATCHES), context, samples)
    # The KV term: the same forwards after four times the context (n = 1 and 8).
    points += measure_curve(runner, [1, 8], list(BATCHES), 4 * context, samples)
    steps = 4 if dry_run else 32
    decode = {
        "context": context,
        "specd_runner_step_ms": runner_step_ms(runner, context, steps),
        "transformers_generate_step_ms": generate_step_ms(model, context, steps),
        "static_cache_compile": NO_COMPILED_PATH,
    }
    out = {
        "shape": shape.name,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "kv_bytes_per_token": runner.kv_bytes_per_token,
        "curve": [p.as_dict() for p in points],
        "ratios": curve_ratios(points),
        "decode": decode,
    }
    del runner, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def cmd_measure(args: argparse.Namespace) -> int:
    device = _device(args.dry_run)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "hardware": _hardware(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "dry_run": args.dry_run,
    }
    for role, shape in ROLES:
        result[role] = measure_role(_shape(shape, args.dry_run), device, args.dry_run)
        r = result[role]
        print(f"gpu_check: {role} {r['shape']}: T(n)/T(1) {r['ratios']}; decode {r['decode']}", flush=True)
    write_json(work / "measure.json", result)
    return 0


def cmd_distill_target(args: argparse.Namespace) -> int:
    folder = save_random_target(_shape(DEMO_TARGET, args.dry_run), Path(args.folder))
    print(f"gpu_check: random-weight {_shape(DEMO_TARGET, args.dry_run).name} target in {folder}")
    return 0


def _tests(xml_path: Path) -> dict[str, Any]:
    """Counts from pytest's junit XML (missing: the tests did not run)."""
    if not xml_path.is_file():
        return {"ran": False}
    root = ET.parse(xml_path).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    assert suite is not None  # pytest writes one suite
    counts = {k: int(suite.get(k) or 0) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "ran": True,
        **counts,
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": failed,
    }


def _distill(folder: Path) -> dict[str, Any]:
    """Held-out top-1 agreement of the draft before and after training (distill-summary.json)."""
    path = folder / "distill-summary.json"
    if not path.is_file():
        return {"ran": False}
    summary = json.loads(path.read_text())
    final, initial = summary.get("final", {}), summary.get("initial", {})
    return {
        "ran": True,
        "steps": summary.get("steps"),
        "wall_seconds": summary.get("wall_seconds"),
        "heldout_top1_agreement_initial": initial.get("val_top1"),
        "heldout_top1_agreement_final": final.get("val_top1"),
        "heldout_kl_final": final.get("val_kl"),
    }


def _cost(role: dict[str, Any]) -> CostModel:
    return fit_cost_model([CurvePoint(**p) for p in role["curve"]])


def cmd_summary(args: argparse.Namespace) -> int:
    work, out = Path(args.work), Path(args.out)
    measure = json.loads((work / "measure.json").read_text())
    target, draft = measure["target"], measure["draft"]
    cost_t, cost_d = _cost(target), _cost(draft)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    kind = "DRY RUN on a CPU with tiny stand-in models, not a measurement of an H200" if args.dry_run else date
    profile = profile_json(
        name="gpu-check-dry-run" if args.dry_run else "h200-measured",
        description=(
            f"Measured by scripts/gpu_check.sh ({kind}): a random-weight {target['shape']} target "
            f"({target['dtype']}) and {draft['shape']} draft, both on {measure['hardware']}, through specd's runner "
            f"(torch {measure['torch']}, transformers {measure['transformers']})."
        ),
        target=(
            f"{target['shape']} ({target['dtype']}, random weights)",
            measure["hardware"],
            target["kv_bytes_per_token"],
            cost_t,
        ),
        draft=(
            f"{draft['shape']} ({draft['dtype']}, random weights)",
            measure["hardware"],
            draft["kv_bytes_per_token"],
            cost_d,
        ),
        measured={
            "date": date,
            "dry_run": args.dry_run,
            "verify_ratio_target": target["ratios"],
            "verify_ratio_draft": draft["ratios"],
        },
    )
    write_json(out / "h200-measured.json", profile)
    summary = {
        **{k: measure[k] for k in ("hardware", "torch", "cuda", "transformers", "dry_run")},
        "date": date,
        "tests": _tests(work / "tests.xml"),
        "verify_cost": {
            role: {k: measure[role][k] for k in ("shape", "dtype", "ratios", "curve")} for role, _ in ROLES
        },
        "decode_step": {role: measure[role]["decode"] for role, _ in ROLES},
        "fitted_cost": {"target": vars(cost_t), "draft": vars(cost_d)},
        "distill": _distill(work / "draft"),
    }
    write_json(out / "summary.json", summary)
    print(f"gpu_check: wrote {out / 'summary.json'} and {out / 'h200-measured.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specd.tools.gpu_check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--work", required=True)
    d = sub.add_parser("distill-target")
    d.add_argument("--folder", required=True)
    s = sub.add_parser("summary")
    s.add_argument("--work", required=True)
    s.add_argument("--out", required=True)
    for p in (m, d, s):
        p.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    commands = {"measure": cmd_measure, "distill-target": cmd_distill_target, "summary": cmd_summary}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
