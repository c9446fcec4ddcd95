"""deploy/k8s: the kustomize base and its overlays, rendered by the real kustomize and checked.

Every kustomization (`kubectl apply -k deploy/k8s`, overlays/gpu, overlays/cpu-local,
overlays/mtls) is rendered with `kubectl kustomize` (tests/deploy/manifests.py) and must:
- be valid against the Kubernetes 1.30 API schema (strict: an unknown field is an error);
- give every container startup-safe liveness and readiness probes, resource requests and limits,
  and the restricted security context (non-root, read-only root filesystem with an emptyDir on
  /tmp, no privilege escalation, no capabilities, RuntimeDefault seccomp);
- wire the services exactly as the serving configuration says: the ConfigMap generated from
  deploy/k8s/base/config/serving.env loads through dspark.serving_config.ServingConfig (the code
  the services run), and its ports and addresses are the container ports, the probes' ports, the
  Services' ports and the gateway's flags (parsed by the real `dspark` argument parser); the
  scheduler's Prometheus port (observability.metrics_port) is its container's `metrics` port, a
  Service port and its scrape annotation;
- select pods that exist (Services, the autoscaler, the disruption budget, NetworkPolicies), and
  admit exactly the intended connections, among them scrapers from namespaces labelled
  dspark.io/monitoring=true to the metrics ports;
- carry no secret: the generated Secret's source file holds no value.
"""

from __future__ import annotations

import json
import os
import tomllib
from urllib.parse import urlsplit

import pytest

from dspark.serving_config import ServingConfig
from tests.deploy.dockerfile import DOCKERFILE, instructions, stages
from tests.deploy.manifests import (
    BASE_DIR,
    DSPARK_SERVICES,
    K8S_DIR,
    KUSTOMIZATIONS,
    REPO,
    all_containers,
    container_env,
    container_ports,
    env_file,
    expand_args,
    generated,
    kustomization,
    named,
    of_kind,
    pod_labels,
    pod_spec,
    probed_grpc_port,
    quantity,
    render,
    render_dir,
    required_module,
    resolve_port,
    secret_data,
    selector_matches,
    the_container,
)

pytestmark = pytest.mark.processes  # renders deploy/k8s with `kubectl kustomize`

ALL = pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
GRPC_SERVICES = ("scheduler", "drafter", "verifier")
SCHEMA_VERSION = "1.30.0"  # an older release still in use (the manifests need >= 1.27: gRPC probes)
IMAGE_UID = 10001  # the USER of deploy/docker/Dockerfile
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def serving_config(objects, service: str) -> ServingConfig:
    """The configuration `dspark <service>` would load in its pod: ServingConfig from exactly the
    environment the manifests give the container (no config file is mounted)."""
    env = container_env(the_container(objects, service), objects)
    assert "DSPARK_CONFIG" not in env
    return ServingConfig.load(None, env=env)


# ---- the rendering itself -----------------------------------------------------------------------


def test_kubectl_apply_k_deploy_k8s_deploys_the_base():
    assert render("base") == render_dir(BASE_DIR)
    assert kustomization(K8S_DIR)["resources"] == ["base"]


_SCHEMA_VALID: set[str] = set()  # objects already validated (the overlays share most of the base's)


@ALL
def test_renders_to_objects_valid_against_the_kubernetes_schema(name):
    kubernetes_validate = required_module("kubernetes_validate")
    objects = render(name)
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == sorted(["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Namespace", "NetworkPolicy",
                            "PodDisruptionBudget", "Secret", "Service"])
    for obj in objects:
        key = json.dumps(obj, sort_keys=True)
        if key in _SCHEMA_VALID:
            continue
        try:
            kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{name}: {obj['kind']} {obj['metadata']['name']}: {e.message}") from None
        _SCHEMA_VALID.add(key)


@ALL
def test_every_object_lives_in_the_dspark_namespace_which_enforces_restricted_pod_security(name):
    objects = render(name)
    namespace = named(objects, "Namespace", "dspark")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "dspark", f"{obj['kind']} {obj['metadata']['name']}"


@ALL
def test_the_system_is_gateway_scheduler_drafter_verifier_redis_and_jaeger(name):
    objects = render(name)
    expected = set(DSPARK_SERVICES) | {"redis", "jaeger"}
    assert {d["metadata"]["name"] for d in of_kind(objects, "Deployment")} == expected
    assert {s["metadata"]["name"] for s in of_kind(objects, "Service")} == expected
    images = {d["metadata"]["name"]: c["image"] for d, c in all_containers(objects)}
    variant = "cuda" if name == "gpu" else "cpu"
    for service in DSPARK_SERVICES:
        # the image of deploy/docker/Dockerfile, tagged <package version>-<variant>
        assert images[service] == f"dspark:{VERSION}-{variant}"
    assert images["redis"].startswith("redis:7") and images["jaeger"].startswith("jaegertracing/jaeger:2")


# ---- every container: probes, resources, security ------------------------------------------------


@ALL
def test_every_container_has_liveness_and_readiness_probes(name):
    for deployment, container in all_containers(render(name)):
        where = f"{name}: {deployment['metadata']['name']}/{container['name']}"
        assert "livenessProbe" in container and "readinessProbe" in container, where
        if "startupProbe" not in container:
            continue
        # a slow start is the startup probe's to allow: liveness only begins after it succeeds
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, where


@ALL
def test_every_container_requests_and_limits_cpu_and_memory(name):
    for deployment, container in all_containers(render(name)):
        where = f"{name}: {deployment['metadata']['name']}/{container['name']}"
        resources = container.get("resources", {})
        for resource in ("cpu", "memory"):
            request = quantity(resources["requests"][resource])
            limit = quantity(resources["limits"][resource])
            assert 0 < request <= limit, f"{where}: {resource} request {request} > limit {limit}"


@ALL
def test_every_pod_runs_non_root_read_only_without_privileges_or_capabilities(name):
    for deployment, container in all_containers(render(name)):
        where = f"{name}: {deployment['metadata']['name']}/{container['name']}"
        pod = pod_spec(deployment)
        pod_security = pod["securityContext"]
        assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0, where
        assert pod_security["seccompProfile"]["type"] == "RuntimeDefault", where
        assert pod["automountServiceAccountToken"] is False, f"{where}: no pod here talks to the Kubernetes API"
        # Service links would inject e.g. DSPARK_VERIFIER_PORT=tcp://10.0.0.1:50053 for a Service
        # named dspark-verifier, which ServingConfig would read (and reject) as its own key.
        assert pod["enableServiceLinks"] is False, where
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, where
        assert security["readOnlyRootFilesystem"] is True, where
        assert security["runAsNonRoot"] is True, where
        assert security["capabilities"] == {"drop": ["ALL"]}, where
        assert not security.get("privileged"), where
        if deployment["metadata"]["name"] in DSPARK_SERVICES:
            assert pod_security["runAsUser"] == IMAGE_UID and pod_security["runAsGroup"] == IMAGE_UID, where


@ALL
def test_read_only_root_filesystems_get_a_writable_empty_dir_on_tmp(name):
    for deployment, container in all_containers(render(name)):
        where = f"{name}: {deployment['metadata']['name']}/{container['name']}"
        volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        assert "/tmp" in mounts, f"{where}: nothing writable on /tmp"
        tmp = volumes[mounts["/tmp"]]
        assert "emptyDir" in tmp and quantity(tmp["emptyDir"]["sizeLimit"]) > 0, where


def test_no_mount_hides_the_model_the_image_ships():
    runtime_env = stages(instructions(DOCKERFILE.read_text()))[-1].env()
    model_dir = runtime_env["DSPARK_CACHE_DIR"]
    for name in KUSTOMIZATIONS:
        for deployment, container in all_containers(render(name)):
            if deployment["metadata"]["name"] not in DSPARK_SERVICES:
                continue
            for mount in container.get("volumeMounts", []):
                path = mount["mountPath"].rstrip("/")
                assert not (model_dir + "/").startswith(path + "/"), f"{name}: a volume on {path} hides {model_dir}"
            assert "command" not in container, "the image's ENTRYPOINT (dspark) must run; pods give only args"


# ---- the serving configuration and the ports ----------------------------------------------------


SECRET_VARIABLES = {f"DSPARK_{section.upper()}_{key.upper()}" for section, key in ServingConfig.secret_keys()}


def test_config_file_names_every_key_of_serving_config_exactly_once():
    path = BASE_DIR / "config" / "serving.env"
    values = env_file(path)
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) == len(values), "a key is given twice"
    # every key but the secrets, which come from Secrets (never from a ConfigMap)
    expected = {f"DSPARK_{section.upper()}_{key.upper()}"
                for section, keys in ServingConfig().to_dict().items() for key in keys} - SECRET_VARIABLES
    assert SECRET_VARIABLES == {"DSPARK_GATEWAY_API_KEYS", "DSPARK_RPC_AUTH_TOKEN"}
    assert set(values) == expected, (f"serving.env must mirror dspark/serving_config.py: missing {sorted(expected - set(values))}, "
                                     f"unknown {sorted(set(values) - expected)}")


@ALL
def test_every_dspark_pod_loads_the_configuration_through_serving_config(name):
    objects = render(name)
    configs = {service: serving_config(objects, service) for service in DSPARK_SERVICES}
    # one configuration for the whole system: every service sees the same
    assert len({c.to_json() for c in configs.values()}) == 1
    config = configs["verifier"]
    for section in GRPC_SERVICES + ("gateway",):
        assert getattr(config, section).host == "0.0.0.0", f"{section} must listen on the pod's interfaces"
    assert config.model.name == "smollm2-135m-instruct"  # the model baked into the image


@ALL
@pytest.mark.parametrize("service", GRPC_SERVICES)
def test_grpc_service_ports_are_the_configured_ones_everywhere(name, service):
    objects = render(name)
    config = serving_config(objects, service)
    endpoint = getattr(config, service)
    container = the_container(objects, service)
    # the scheduler also serves its Prometheus metrics (test below); drafter and verifier serve none
    metrics = {"metrics": config.observability.metrics_port} if service == "scheduler" else {}
    assert container_ports(container) == {"grpc": endpoint.port, **metrics}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # standard grpc.health.v1 checking, which every service serves (under mutual TLS through
        # `dspark healthcheck`, tests/deploy/test_k8s_mtls.py)
        assert probed_grpc_port(container[probe]) == endpoint.port, f"{service} {probe}"
    # clients dial <Service name>:<Service port>, which must reach the container port
    host, _, port = endpoint.address.partition(":")
    svc = named(objects, "Service", host)
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
    assert svc_port["port"] == int(port)
    assert resolve_port(svc_port["targetPort"], container) == endpoint.port


@ALL
def test_the_scheduler_metrics_port_is_the_configured_one_everywhere(name):
    objects = render(name)
    metrics_port = serving_config(objects, "scheduler").observability.metrics_port
    assert metrics_port > 0, "the scheduler's Prometheus endpoint is off"
    container = the_container(objects, "scheduler")
    assert container_ports(container)["metrics"] == metrics_port
    annotations = named(objects, "Deployment", "scheduler")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(metrics_port)
    (svc_port,) = [p for p in named(objects, "Service", "scheduler")["spec"]["ports"] if p["name"] == "metrics"]
    assert svc_port["port"] == metrics_port and resolve_port(svc_port["targetPort"], container) == metrics_port


@ALL
@pytest.mark.parametrize("service", GRPC_SERVICES)
def test_grpc_services_are_started_by_the_dspark_cli_with_the_configuration_alone(name, service):
    from dspark.cli import build_parser

    container = the_container(render(name), service)
    args = build_parser().parse_args(container["args"])
    assert args.func.__name__ == f"cmd_{service}"
    # no flag overrides the configuration; no config file: the environment is the configuration
    flags = {dest: getattr(args, dest) for dest in args.config_flags if getattr(args, dest) is not None}
    assert flags == {} and args.config is None, f"{service} flags override the configuration: {flags}, --config {args.config}"


@ALL
def test_gateway_flags_expand_to_the_configured_host_port_model_and_redis(name):
    from dspark.cli import build_parser

    objects = render(name)
    container = the_container(objects, "gateway")
    env = container_env(container, objects)
    argv = expand_args(container["args"], env)
    assert not any("$(" in a for a in argv), f"unexpanded variables in {argv}"
    args = build_parser().parse_args(argv)
    config = ServingConfig.load(None, env=env)
    assert args.func.__name__ == "cmd_gateway"
    assert (args.host, args.port) == (config.gateway.host, config.gateway.port)
    assert args.redis == config.redis.url and args.model == config.model.name
    assert args.max_tokens_limit == config.gateway.max_tokens_limit
    assert container_ports(container) == {"http": config.gateway.port}
    for probe, path in (("startupProbe", "/health"), ("readinessProbe", "/health"), ("livenessProbe", "/live")):
        # readiness follows the bus (/health); liveness only the process (/live): a Redis outage restarts nothing
        http = container[probe]["httpGet"]
        assert http["path"] == path and resolve_port(http["port"], container) == config.gateway.port
    annotations = named(objects, "Deployment", "gateway")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.gateway.port) and annotations["prometheus.io/path"] == "/metrics"
    (svc_port,) = named(objects, "Service", "gateway")["spec"]["ports"]
    assert resolve_port(svc_port["targetPort"], container) == config.gateway.port


@ALL
def test_redis_url_and_otlp_endpoint_reach_the_redis_and_jaeger_services(name):
    objects = render(name)
    env = container_env(the_container(objects, "scheduler"), objects)
    for url, service, port_name in ((ServingConfig.load(None, env=env).redis.url, "redis", "redis"),
                                    (env["OTEL_EXPORTER_OTLP_ENDPOINT"], "jaeger", "otlp-grpc")):
        parts = urlsplit(url)
        svc = named(objects, "Service", parts.hostname)
        assert svc["metadata"]["name"] == service
        port = next(p for p in svc["spec"]["ports"] if p["port"] == parts.port)
        assert port["name"] == port_name
        assert resolve_port(port["targetPort"], the_container(objects, service)) == parts.port
    for service in DSPARK_SERVICES:
        assert container_env(the_container(objects, service), objects)["OTEL_SERVICE_NAME"] == f"dspark-{service}"


# ---- selectors ----------------------------------------------------------------------------------


@ALL
def test_deployment_selectors_match_their_own_pod_templates_and_no_other(name):
    deployments = of_kind(render(name), "Deployment")
    for deployment in deployments:
        picked = [d["metadata"]["name"] for d in deployments if selector_matches(deployment["spec"]["selector"], pod_labels(d))]
        assert picked == [deployment["metadata"]["name"]]


@ALL
def test_every_service_selects_the_pods_of_exactly_one_deployment_on_declared_ports(name):
    objects = render(name)
    deployments = of_kind(objects, "Deployment")
    for svc in of_kind(objects, "Service"):
        picked = [d for d in deployments if selector_matches({"matchLabels": svc["spec"]["selector"]}, pod_labels(d))]
        assert [d["metadata"]["name"] for d in picked] == [svc["metadata"]["name"]], f"Service {svc['metadata']['name']}"
        (container,) = pod_spec(picked[0])["containers"]
        for port in svc["spec"]["ports"]:
            resolve_port(port["targetPort"], container)  # a named target port must exist on the pod


@ALL
def test_config_maps_and_secrets_referenced_by_pods_exist(name):
    objects = render(name)
    containers = list(all_containers(objects))
    assert containers, f"overlay {name} renders no containers: nothing was checked"
    for deployment, container in containers:
        container_env(container, objects)  # resolves every envFrom and valueFrom reference, or fails


@ALL
def test_gateway_has_an_autoscaler_and_a_disruption_budget_for_its_pods_only(name):
    objects = render(name)
    gateway = named(objects, "Deployment", "gateway")
    assert "replicas" not in gateway["spec"], "the autoscaler owns the gateway's replica count"
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (pdb,) = of_kind(objects, "PodDisruptionBudget")
    picked = [d["metadata"]["name"] for d in of_kind(objects, "Deployment") if selector_matches(pdb["spec"]["selector"], pod_labels(d))]
    assert picked == ["gateway"]
    # a drain may always take one replica (also with a single one locally), never more
    assert pdb["spec"]["maxUnavailable"] == 1
    if name != "cpu-local":
        assert hpa["spec"]["minReplicas"] >= 2


# ---- secrets ------------------------------------------------------------------------------------


def _kustomization_dirs():
    return sorted({p.parent for p in K8S_DIR.rglob("kustomization.yaml")})


def test_no_secret_value_is_committed():
    for directory in _kustomization_dirs():
        for generator in kustomization(directory).get("secretGenerator", []):
            assert "literals" not in generator, f"{directory}: a secretGenerator with literal values"
            for source in generator.get("envs", []) + generator.get("files", []):
                values = env_file(directory / source)
                assert all(v == "" for v in values.values()), f"{directory / source} holds a secret value"
    for path in K8S_DIR.rglob("*.yaml"):
        if path.name != "kustomization.yaml":
            assert "kind: Secret" not in path.read_text(), f"{path}: a Secret written into a manifest"
    for name in KUSTOMIZATIONS:
        for secret in of_kind(render(name), "Secret"):
            assert all(v == "" for v in secret_data(secret).values()), f"{name}: Secret {secret['metadata']['name']} has a value"


def _own_overlay(tmp_path, secrets: dict[str, str]):
    """Your own overlay beside the checkout: the base with each named Secret replaced from a file
    you do not commit. Returns its rendered objects."""
    generators = ""
    for name, line in secrets.items():
        (tmp_path / f"{name}.env").write_text(line + "\n")
        generators += f"  - name: {name}\n    behavior: replace\n    envs:\n      - {name}.env\n"
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(BASE_DIR, tmp_path)}\nsecretGenerator:\n{generators}"
    )
    return render_dir(tmp_path)


def test_api_keys_come_from_the_secret_and_an_own_overlay_can_replace_it(tmp_path):
    from gateway.api_keys import hash_api_key

    hashes = f"{hash_api_key('key-one')},{hash_api_key('key-two')}"
    own = _own_overlay(tmp_path, {"dspark-api-keys": f"DSPARK_GATEWAY_API_KEYS={hashes}"})
    for objects, expected in ((render("base"), ""), (own, hashes)):
        secret = generated(objects, "Secret", "dspark-api-keys")
        assert secret_data(secret) == {"DSPARK_GATEWAY_API_KEYS": expected}
        env = the_container(objects, "gateway")["env"]
        (ref,) = [v["valueFrom"]["secretKeyRef"] for v in env if v["name"] == "DSPARK_GATEWAY_API_KEYS"]
        assert ref == {"name": secret["metadata"]["name"], "key": "DSPARK_GATEWAY_API_KEYS"}
        assert serving_config(objects, "gateway").gateway.api_keys == expected  # what `dspark gateway` loads
        for service in GRPC_SERVICES:  # the keys reach the gateway only
            assert "DSPARK_GATEWAY_API_KEYS" not in container_env(the_container(objects, service), objects)


def test_the_internal_token_comes_from_its_secret_to_the_grpc_services_only(tmp_path):
    token = "0123456789abcdef0123456789abcdef"
    own = _own_overlay(tmp_path, {"dspark-rpc-token": f"DSPARK_RPC_AUTH_TOKEN={token}"})
    for objects, expected in ((render("base"), ""), (own, token)):
        secret = generated(objects, "Secret", "dspark-rpc-token")
        assert secret_data(secret) == {"DSPARK_RPC_AUTH_TOKEN": expected}
        for service in GRPC_SERVICES:  # the scheduler sends it, the verifier and drafter require it
            assert serving_config(objects, service).rpc.auth_token == expected
        assert "DSPARK_RPC_AUTH_TOKEN" not in container_env(the_container(objects, "gateway"), objects)  # it speaks no gRPC


TLS_DIR = "/etc/dspark/grpc-tls"  # where the gRPC pods mount the optional Secret dspark-grpc-tls
TLS_ENV = {"DSPARK_RPC_TLS_CA_PATH": f"{TLS_DIR}/ca.crt", "DSPARK_RPC_TLS_CERT_PATH": f"{TLS_DIR}/tls.crt",
           "DSPARK_RPC_TLS_KEY_PATH": f"{TLS_DIR}/tls.key"}


def test_the_grpc_services_mount_the_optional_tls_secret_and_an_own_overlay_turns_tls_on(tmp_path):
    literals = "".join(f"      - {k}={v}\n" for k, v in TLS_ENV.items())
    (tmp_path / "kustomization.yaml").write_text(  # the configuration part of components/mtls, by hand (the component: test_k8s_mtls.py)
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(BASE_DIR, tmp_path)}\n"
        f"configMapGenerator:\n  - name: dspark-serving\n    behavior: merge\n    literals:\n{literals}")
    for objects, expected in ((render("base"), ("", "", "")), (render_dir(tmp_path), tuple(TLS_ENV.values()))):
        for service in GRPC_SERVICES:
            deployment = named(objects, "Deployment", service)
            mounts = {m["name"]: m for m in the_container(objects, service)["volumeMounts"]}
            volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
            assert mounts["grpc-tls"]["mountPath"] == TLS_DIR and mounts["grpc-tls"]["readOnly"] is True
            # optional: without the Secret the pods start (plaintext); the key is not world-readable
            assert volumes["grpc-tls"]["secret"] == {"secretName": "dspark-grpc-tls", "optional": True, "defaultMode": 0o440}
            rpc = serving_config(objects, service).rpc
            assert (rpc.tls_ca_path, rpc.tls_cert_path, rpc.tls_key_path) == expected
        gateway_mounts = the_container(objects, "gateway").get("volumeMounts", [])
        assert all(m["mountPath"] != TLS_DIR for m in gateway_mounts)  # it speaks no gRPC


# ---- network policies ---------------------------------------------------------------------------

ANYONE = "anyone"  # any pod of the cluster and any client outside it


def namespaces_labelled(labels: dict[str, str]) -> str:
    """The source "pods in the namespaces carrying all of `labels`"."""
    return "namespaces labelled " + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


MONITORING = namespaces_labelled({"dspark.io/monitoring": "true"})  # where the Prometheus scrapers run


def _namespace_source(peer) -> str | None:
    """A peer whose namespaceSelector picks namespaces by labels alone, as its source; else None."""
    selector = peer.get("namespaceSelector")
    if selector is None or "ipBlock" in peer or selector.get("matchExpressions") or not selector.get("matchLabels"):
        return None
    return namespaces_labelled(selector["matchLabels"])


def admitted_connections(objects) -> set[tuple[str, str, int]]:
    """(source, destination, port) that the NetworkPolicies admit, between the Deployments' pods
    (by name), ANYONE and namespaces_labelled(...), evaluated as the API defines it: a pod
    selected by no Ingress policy admits everything; otherwise the union of the selecting
    policies' rules; a rule without `from` admits any source, without `ports` any port; a peer
    with only a podSelector means pods of the policy's own namespace; one with a
    namespaceSelector of matchLabels the pods of the namespaces so labelled (all of them, also
    with a podSelector beside it: an upper bound); any other namespaceSelector or an ipBlock
    reaches anyone."""
    deployments = of_kind(objects, "Deployment")
    policies = [p for p in of_kind(objects, "NetworkPolicy") if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    edges: set[tuple[str, str, int]] = set()
    for destination in deployments:
        dest_name, (container,) = destination["metadata"]["name"], pod_spec(destination)["containers"]
        every_port = sorted(container_ports(container).values())
        selecting = [p for p in policies if selector_matches(p["spec"]["podSelector"], pod_labels(destination))]
        if not selecting:
            edges |= {(ANYONE, dest_name, port) for port in every_port}
            continue
        for policy in selecting:
            for rule in policy["spec"].get("ingress", []):
                sources = set()
                for peer in rule.get("from") or [{}]:
                    if (namespaces := _namespace_source(peer)) is not None:
                        sources.add(namespaces)
                    elif peer == {} or "namespaceSelector" in peer or "ipBlock" in peer:
                        sources.add(ANYONE)
                    else:
                        sources |= {d["metadata"]["name"] for d in deployments if selector_matches(peer["podSelector"], pod_labels(d))}
                ports = [resolve_port(p["port"], container) for p in rule.get("ports", [])] or every_port
                edges |= {(source, dest_name, port) for source in sources for port in ports}
    return edges


@ALL
def test_network_policies_admit_exactly_the_intended_connections(name):
    objects = render(name)
    config = serving_config(objects, "scheduler")
    redis_port = urlsplit(config.redis.url).port
    expected = {
        (ANYONE, "gateway", config.gateway.port),  # the only way in from outside
        ("gateway", "redis", redis_port),
        ("scheduler", "redis", redis_port),
        ("scheduler", "drafter", config.drafter.port),
        ("scheduler", "verifier", config.verifier.port),
    }
    expected |= {(service, "jaeger", port) for service in DSPARK_SERVICES for port in (4317, 4318)}  # OTLP gRPC, HTTP
    expected |= {  # Prometheus: the metrics ports, from the monitoring namespaces only
        (MONITORING, "scheduler", config.observability.metrics_port),
        (MONITORING, "gateway", config.gateway.port),  # /metrics on the API port
    }
    assert admitted_connections(objects) == expected


def test_the_network_policy_check_sees_a_hole():
    # the evaluator above must not pass everything: widen one rule to any source, drop a policy
    objects = render("base")
    verifier_port = serving_config(objects, "verifier").verifier.port
    assert (ANYONE, "verifier", verifier_port) not in admitted_connections(objects)
    del named(objects, "NetworkPolicy", "verifier-from-scheduler")["spec"]["ingress"][0]["from"]
    assert (ANYONE, "verifier", verifier_port) in admitted_connections(objects)
    unguarded = [o for o in objects if o["metadata"]["name"] not in ("default-deny-ingress", "jaeger-otlp-from-services")]
    assert (ANYONE, "jaeger", 16686) in admitted_connections(unguarded)
    # a scraper policy that does not pick namespaces by label opens the metrics port to everyone
    metrics_port = serving_config(objects, "scheduler").observability.metrics_port
    assert (ANYONE, "scheduler", metrics_port) not in admitted_connections(objects)
    named(objects, "NetworkPolicy", "scheduler-metrics-from-monitoring")["spec"]["ingress"][0]["from"][0]["namespaceSelector"] = {}
    assert (ANYONE, "scheduler", metrics_port) in admitted_connections(objects)


# ---- overlays -----------------------------------------------------------------------------------


@ALL
def test_only_the_gpu_overlay_puts_drafter_and_verifier_on_gpus(name):
    objects = render(name)
    with_gpu = set()
    for deployment, container in all_containers(objects):
        resources = container["resources"]
        limit = resources["limits"].get("nvidia.com/gpu")
        if limit is None:
            assert "nvidia.com/gpu" not in resources.get("requests", {})
            continue
        with_gpu.add(deployment["metadata"]["name"])
        assert quantity(limit) == 1 and quantity(resources["requests"].get("nvidia.com/gpu", limit)) == 1
        spec = pod_spec(deployment)
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert with_gpu == ({"drafter", "verifier"} if name == "gpu" else set())


@ALL
def test_the_device_each_model_service_runs_on_is_the_device_its_pod_gets(name):
    """model.device, as the pod's environment resolves it: cuda exactly where the container
    is given a GPU (the drafter and the verifier of the gpu overlay), cpu everywhere else; a
    pod that asked for cuda without a GPU would fail at start-up, one with a GPU and cpu would
    leave it idle."""
    objects = render(name)
    for service in ("drafter", "verifier"):
        resources = the_container(objects, service)["resources"]
        has_gpu = "nvidia.com/gpu" in resources.get("limits", {})
        device = serving_config(objects, service).model.device
        assert device == ("cuda" if has_gpu else "cpu"), f"{name}: {service} runs on {device!r}, GPU limit: {has_gpu}"


@ALL
def test_only_the_gateway_is_exposed_and_on_a_node_port_only_locally(name):
    for svc in of_kind(render(name), "Service"):
        kind = svc["spec"].get("type", "ClusterIP")
        if name == "cpu-local" and svc["metadata"]["name"] == "gateway":
            assert kind == "NodePort" and svc["spec"]["ports"][0]["nodePort"] == 30080
        else:
            assert kind == "ClusterIP", f"{name}: Service {svc['metadata']['name']} is {kind}"


def test_cpu_local_overlay_asks_for_less_than_the_base():
    base, local = render("base"), render("cpu-local")
    for deployment, container in all_containers(local):
        original = the_container(base, deployment["metadata"]["name"])
        for bound in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                assert quantity(container["resources"][bound][resource]) <= quantity(original["resources"][bound][resource])
    assert serving_config(local, "verifier").model.kv_budget_mb < serving_config(base, "verifier").model.kv_budget_mb
    # the verifier's KV budget fits in its memory limit, with room for the model and activations
    for objects in (base, local):
        limit = quantity(the_container(objects, "verifier")["resources"]["limits"]["memory"])
        assert serving_config(objects, "verifier").model.kv_budget_mb * 2**20 + 2 * 2**30 <= limit
