"""Rendering the Kubernetes manifests of deploy/k8s, and reading what a cluster would make of them.

`render(name)` runs the real kustomize (`kubectl kustomize`, kustomize v5 built into kubectl,
which every machine of this project has) on the base (`deploy/k8s`) or an overlay, and returns
the objects it prints. The other helpers answer the questions the tests ask of those objects
the way the API server and the kubelet would: which pods a label selector picks, what
environment a container's process sees (envFrom ConfigMaps, then `env`), what its args expand
to (`$(VAR)`), which port a named port is.

Without kubectl (or the `test` extra's kubernetes-validate) the tests that need it are skipped
on a developer's machine and fail in CI (CI=true), so that CI cannot pass them vacuously.
"""

from __future__ import annotations

import base64
import copy
import functools
import importlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "deploy" / "k8s"
BASE_DIR = K8S_DIR / "base"
KUSTOMIZATIONS = {  # what `kubectl apply -k` is pointed at
    "base": K8S_DIR,
    "gpu": K8S_DIR / "overlays" / "gpu",
    "cpu-local": K8S_DIR / "overlays" / "cpu-local",
    "mtls": K8S_DIR / "overlays" / "mtls",  # the base with components/mtls
}
DSPARK_SERVICES = ("gateway", "scheduler", "drafter", "verifier")  # the pods that run the dspark image

Obj = dict[str, Any]


def _missing(message: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(message + " (and CI must have it)")
    pytest.skip(message)


def kubectl() -> str:
    """Path of kubectl; skips the test without it (fails it in CI, see the module docstring)."""
    path = shutil.which("kubectl")
    if path is None:
        _missing("kubectl (with its built-in kustomize) is needed to render deploy/k8s")
    return path


def required_module(name: str) -> ModuleType:
    """An optional test dependency (the `test` extra), imported; skipped without it, failed in CI."""
    try:
        return importlib.import_module(name)
    except ImportError:
        _missing(f"{name} is needed (pip install -e '.[test]')")


def render_dir(path: Path) -> list[Obj]:
    """`kubectl kustomize PATH`: the objects, in kustomize's output order."""
    result = subprocess.run([kubectl(), "kustomize", str(path)], check=False, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{result.stderr}")
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]


@functools.cache
def _render_cached(name: str) -> tuple[Obj, ...]:
    return tuple(render_dir(KUSTOMIZATIONS[name]))


def render(name: str) -> list[Obj]:
    """The rendered objects of a kustomization in KUSTOMIZATIONS (rendered once per session; a
    fresh copy each call, so that a test may change what it gets)."""
    return copy.deepcopy(list(_render_cached(name)))


# ---- finding objects ----------------------------------------------------------------------------


def of_kind(objects: Iterable[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: Iterable[Obj], kind: str, name: str) -> Obj:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} named {name!r}, found {len(found)}"
    return found[0]


def generated(objects: Iterable[Obj], kind: str, name: str) -> Obj:
    """A generated ConfigMap/Secret: kustomize appends a content hash, `name-<hash>`."""
    found = [o for o in of_kind(objects, kind) if re.fullmatch(re.escape(name) + r"-[a-z0-9]{10}", o["metadata"]["name"])]
    assert len(found) == 1, f"expected one generated {kind} {name}-<hash>, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(deployment: Obj) -> Obj:
    return deployment["spec"]["template"]["spec"]


def pod_labels(deployment: Obj) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"].get("labels", {})


def containers(deployment: Obj) -> list[Obj]:
    spec = pod_spec(deployment)
    return spec.get("initContainers", []) + spec["containers"]


def all_containers(objects: Iterable[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(deployment, container) for every container of every Deployment."""
    for deployment in of_kind(objects, "Deployment"):
        for container in containers(deployment):
            yield deployment, container


def the_container(objects: Iterable[Obj], deployment_name: str) -> Obj:
    (container,) = pod_spec(named(objects, "Deployment", deployment_name))["containers"]
    return container


# ---- what the API server and the kubelet make of them ------------------------------------------


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against a set of labels; {} matches all."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        ok = {
            "In": present and labels[key] in values,
            "NotIn": not present or labels[key] not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]
        if not ok:
            return False
    return True


def container_ports(container: Obj) -> dict[str, int]:
    """Named container ports: name -> number."""
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def resolve_port(port: int | str, container: Obj) -> int:
    """A port given as a number or as the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    ports = container_ports(container)
    assert port in ports, f"container {container['name']} has no port named {port!r} (it has {sorted(ports)})"
    return ports[port]


def probed_grpc_port(probe: Obj) -> int:
    """The port whose grpc.health.v1 service a probe checks: the kubelet's own (`grpc:`), or an
    exec of `dspark healthcheck --target 127.0.0.1:PORT` (parsed by its real parser)."""
    if "grpc" in probe:
        return probe["grpc"]["port"]
    from services.healthcheck import healthcheck_parser

    command = probe["exec"]["command"]
    assert command[:2] == ["dspark", "healthcheck"], f"not a gRPC health probe: {probe}"
    host, _, port = healthcheck_parser().parse_args(command[2:]).target.rpartition(":")
    assert host == "127.0.0.1", f"an exec probe checks its own container: {command}"
    return int(port)


def container_env(container: Obj, objects: Iterable[Obj]) -> dict[str, str]:
    """The environment the container's process starts with, from the manifests: every envFrom
    ConfigMap / Secret in order, then `env` (later wins, as in the kubelet). Values taken from
    the downward API (resourceFieldRef, fieldRef) are left out."""
    objects = list(objects)
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(named(objects, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
        elif "secretRef" in source:
            env.update(secret_data(named(objects, "Secret", source["secretRef"]["name"])))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secret_data(named(objects, "Secret", ref["name"]))[ref["key"]]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = named(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def expand_args(args: Iterable[str], env: Mapping[str, str]) -> list[str]:
    """The kubelet's expansion of `$(VAR)` in command/args ($$ escapes a $; an undefined variable
    stays as written)."""

    def expand(arg: str) -> str:
        return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                      lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)

    return [expand(arg) for arg in args]


def secret_data(secret: Obj) -> dict[str, str]:
    """A Secret's values, decoded (`data` is base64, `stringData` plain)."""
    values = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    values.update(secret.get("stringData") or {})
    return values


_QUANTITY_SUFFIXES = {"m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
                      "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value: float | str) -> float:
    """A Kubernetes resource quantity ("500m", "2", "1536Mi", 1) as a number."""
    if isinstance(value, (int, float)):
        return float(value)
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", value)
    assert match and match.group(2) in _QUANTITY_SUFFIXES, f"not a resource quantity: {value!r}"
    return float(match.group(1)) * _QUANTITY_SUFFIXES[match.group(2)]


def kustomization(path: Path) -> Obj:
    return yaml.safe_load((path / "kustomization.yaml").read_text())


def env_file(path: Path) -> dict[str, str]:
    """A kustomize env file (KEY=value lines, # comments) as a dict."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path}: {line!r} is not KEY=value"
            values[key] = value
    return values
