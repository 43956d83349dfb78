"""Validate Prometheus Operator objects against the operator's CRD schemas, offline.

    PYTHONPATH=.tools/crdlib python tests/operator_crds.py FILE.yaml...

The schemas come from PyPI's cloudcoil-models-prometheus-operator (the
monitoring.coreos.com CRDs of operator v0.80.1 as pydantic models, with the
CRDs' types, enums, patterns and required fields), installed into
.tools/crdlib by scripts/k8s-tools.sh. Strict like `kubernetes-validate
--strict`: an object must validate, and dumping it back must give exactly
what was written, so an unknown (misspelt) field or a value the schema had
to coerce is an error too. Prints one line per problem; exit status 1 if any.
Runs in its own process: the models bring their own pydantic.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml
from cloudcoil.models.prometheus_operator import v1
from pydantic import BaseModel, ValidationError

MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): v1.ServiceMonitor,
    ("monitoring.coreos.com/v1", "PodMonitor"): v1.PodMonitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): v1.PrometheusRule,
}


def differences(written: Any, read: Any, path: str = "") -> list[str]:
    """Where `read` (the model's dump) differs from `written`: dropped fields, changed values."""
    if isinstance(written, dict) and isinstance(read, dict):
        out = []
        for key in written:
            if key not in read:
                out.append(f"{path}/{key}: not a field of the schema")
            else:
                out.extend(differences(written[key], read[key], f"{path}/{key}"))
        return out
    if isinstance(written, list) and isinstance(read, list) and len(written) == len(read):
        return [d for i, (w, r) in enumerate(zip(written, read)) for d in differences(w, r, f"{path}/{i}")]
    if type(written) is not type(read) or written != read:
        return [f"{path}: {written!r} is read as {read!r}"]
    return []


def problems(obj: dict[str, Any]) -> list[str]:
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    name = f"{key[1]}/{(obj.get('metadata') or {}).get('name', '?')}"
    model = MODELS.get(key)
    if model is None:
        return [f"{name}: no schema for {key[0]} {key[1]}"]
    try:
        parsed = model.model_validate(obj)
    except ValidationError as exc:
        return [f"{name}: {'/'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    read = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [f"{name}: {d}" for d in differences(obj, read)]


def main(paths: list[str]) -> int:
    found = []
    for path in paths:
        with open(path) as f:
            for obj in yaml.safe_load_all(f):
                if obj:
                    found.extend(problems(obj))
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
