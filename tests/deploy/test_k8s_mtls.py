"""deploy/k8s/components/mtls: mutual TLS of the internal gRPC calls, as rendered by the real kustomize.

Specification: overlays/mtls (the base with the component) and an overlay of your own that adds
the component to overlays/gpu both render, and there, for scheduler, drafter and verifier:
- every probe (startup, readiness, liveness) is an exec of `dspark healthcheck` (the image's
  entry point, parsed by the command's real parser) with no `grpc:` probe left, checking
  127.0.0.1 on the container's own gRPC port (the configured one) for the server name the
  scheduler dials (the Service's name, which the certificate carries), with a --timeout below the
  probe's timeoutSeconds;
- the Secret dspark-grpc-tls is mounted read-only and is no longer optional;
- the configuration the service loads (ServingConfig from the container's environment) points
  rpc.tls_* at ca.crt, tls.crt and tls.key inside that mount.
Everything else is the overlay's as without the component. The checks every kustomization gets
(schema, security, ports, network policies) run on overlays/mtls in test_k8s_manifests.py.
"""

from __future__ import annotations

import os

import pytest

from services.healthcheck import healthcheck_parser
from tests.deploy.dockerfile import DOCKERFILE, exec_form, instructions, stages
from tests.deploy.manifests import (
    K8S_DIR,
    container_env,
    container_ports,
    kustomization,
    named,
    pod_spec,
    render,
    render_dir,
    the_container,
)
from tests.deploy.test_k8s_manifests import GRPC_SERVICES, serving_config

pytestmark = pytest.mark.processes  # renders deploy/k8s with `kubectl kustomize`

COMPONENT = K8S_DIR / "components" / "mtls"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
SECRET_FILES = {"tls_ca_path": "ca.crt", "tls_cert_path": "tls.crt", "tls_key_path": "tls.key"}  # a cert-manager Secret's keys


def _gpu_with_mtls(tmp_path):
    """An overlay of your own: overlays/gpu plus the component (what the README tells you to write)."""
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(K8S_DIR / 'overlays' / 'gpu', tmp_path)}\n"
        f"components:\n  - {os.path.relpath(COMPONENT, tmp_path)}\n")
    return render_dir(tmp_path)


@pytest.fixture(params=["mtls", "gpu+mtls"])
def with_mtls(request, tmp_path):
    """(name, rendered objects, the same overlay without the component)."""
    if request.param == "mtls":
        return "mtls", render("mtls"), render("base")
    return "gpu+mtls", _gpu_with_mtls(tmp_path), render("gpu")


def test_overlays_mtls_is_the_base_with_the_component():
    overlay = kustomization(K8S_DIR / "overlays" / "mtls")
    assert overlay["resources"] == ["../../base"] and overlay["components"] == ["../../components/mtls"]
    assert kustomization(COMPONENT)["kind"] == "Component"


@pytest.mark.parametrize("service", GRPC_SERVICES)
def test_every_probe_execs_dspark_healthcheck_on_the_containers_own_grpc_port(with_mtls, service):
    name, objects, _ = with_mtls
    container = the_container(objects, service)
    endpoint = getattr(serving_config(objects, service), service)
    assert container_ports(container)["grpc"] == endpoint.port
    # the certificate names what the clients dial: the Service's name (`verifier` of verifier:50053)
    dialled_host = endpoint.dial.rpartition(":")[0]
    assert dialled_host == named(objects, "Service", service)["metadata"]["name"]
    (entrypoint,) = stages(instructions(DOCKERFILE.read_text()))[-1].all("ENTRYPOINT")
    for probe_name in PROBES:
        probe = container[probe_name]
        where = f"{name}: {service} {probe_name}"
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"exec"}, where  # the plaintext gRPC probe is gone
        command = probe["exec"]["command"]
        assert command[:2] == exec_form(entrypoint) + ["healthcheck"], where  # `dspark`, on the image's PATH
        args = healthcheck_parser().parse_args(command[2:])
        assert args.target == f"127.0.0.1:{endpoint.port}" and args.server_name == dialled_host, where
        assert args.service == "" and args.config is None, where  # the server as a whole, the pod's configuration
        assert args.timeout < probe.get("timeoutSeconds", 1), f"{where}: the probe would be killed before it says why"


@pytest.mark.parametrize("service", GRPC_SERVICES)
def test_the_tls_secret_is_required_and_the_configuration_points_at_its_files(with_mtls, service):
    name, objects, _ = with_mtls
    container = the_container(objects, service)
    volume = {v["name"]: v for v in pod_spec(named(objects, "Deployment", service))["volumes"]}["grpc-tls"]
    assert volume["secret"]["secretName"] == "dspark-grpc-tls"
    assert volume["secret"]["optional"] is False, f"{name}: {service} would start in plaintext without the Secret"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "grpc-tls"]
    assert mount["readOnly"] is True
    rpc = serving_config(objects, service).rpc  # loaded through ServingConfig, as `dspark <service>` does
    for key, file in SECRET_FILES.items():
        assert getattr(rpc, key) == f"{mount['mountPath']}/{file}", f"{name}: {service} rpc.{key}"
    assert "DSPARK_RPC_TLS_CA_PATH" in container_env(container, objects)


def test_the_component_changes_only_the_grpc_services_probes_tls_mount_and_configuration(with_mtls):
    name, objects, without = with_mtls
    for service in GRPC_SERVICES + ("gateway", "redis", "jaeger"):
        with_component, plain = the_container(objects, service), the_container(without, service)
        if service in GRPC_SERVICES:
            for probe_name in PROBES:
                for field in ("periodSeconds", "failureThreshold"):
                    assert with_component[probe_name][field] == plain[probe_name][field], f"{name}: {service} {probe_name}"
                with_component.pop(probe_name), plain.pop(probe_name)
        # the serving ConfigMap's name carries its content hash, which the TLS keys change
        for container in (with_component, plain):
            for source in container.get("envFrom", []):
                if source.get("configMapRef", {}).get("name", "").startswith("dspark-serving-"):
                    source["configMapRef"]["name"] = "dspark-serving"
        assert with_component == plain, f"{name}: {service}"
