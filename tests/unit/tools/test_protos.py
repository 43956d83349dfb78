"""The checked-in generated code must be exactly what scripts/gen-protos makes."""

import re
from pathlib import Path

import pytest

from specd.tools import protogen

pytest.importorskip("grpc_tools")


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    written = protogen.generate(tmp_path)
    checked_in = protogen.REPO_ROOT / protogen.PROTO_PACKAGE
    fresh = {p.name: p.read_text() for p in written}
    current = {p.name: p.read_text() for p in checked_in.iterdir() if p.suffix in {".py", ".pyi"}}
    assert sorted(fresh) == sorted(current), "generated file set differs: run scripts/gen-protos"
    stale = [name for name in fresh if fresh[name] != current[name]]
    assert not stale, f"stale generated code {stale}: run scripts/gen-protos and commit the result"


def test_every_enum_starts_with_unspecified() -> None:
    for proto in protogen.proto_files():
        text = proto.read_text()
        for body in re.findall(r"enum \w+ \{(.*?)\}", text, flags=re.S):
            first = re.search(r"(\w+)\s*=\s*0;", body)
            assert first and first.group(1).endswith("UNSPECIFIED"), f"{proto.name}: {first}"
