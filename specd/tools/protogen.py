"""Generate the Python gRPC code for the v1 contract.

``python -m specd.tools.protogen [--out DIR]`` compiles ``protos/specd/v1/*.proto``
into ``DIR/specd/v1`` (default: the repository root, i.e. ``specd/v1``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE = Path("specd") / "v1"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Compile every v1 proto into out_root/specd/v1; return the files written."""
    from grpc_tools import protoc  # noqa: PLC0415 - a dev dependency, only needed to regenerate

    out_dir = out_root / PROTO_PACKAGE
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    sources = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {sources}")
    init = out_dir / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC code for the specd.v1 contract (scripts/gen-protos)."""\n')
    return sorted(p for p in out_dir.iterdir() if p.suffix in {".py", ".pyi"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: repo root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
