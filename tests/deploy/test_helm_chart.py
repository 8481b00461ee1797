"""deploy/helm/tandem checked offline, with Helm's own library (helm-python-sdk: Helm v4's Go SDK in a wheel, no helm
binary, no cluster): the chart lints and renders for its default values and the value sets in ci/ (CPU demo, one
GPU node, multi-node GPU); every rendered core object validates against Kubernetes' schemas (kubernetes-validate,
strict: unknown fields fail) at the oldest and the newest version the chart supports; the RayCluster validates
against the KubeRay CRD in tests/deploy/schemas/kuberay/ (and has no field the CRD would silently prune); the
manifest in the ConfigMap passes `tandem validate`; what the objects promise (probes, ports, the NetworkPolicy,
Ray resources that match the manifest) holds; and bad values fail the install with their messages."""

from __future__ import annotations

import base64
import copy
import functools
import math
import re
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tandem.cluster.manifest_checks import validate_file
from tests.deploy.helm_render import (CHART, NAMESPACE, RELEASE, ROOT, VALUE_SETS, control_pod, manifest_text, merged,
                                      one, ray_offers, render, values_of)
from tests.deploy.model_shapes import LLAMA3_8B, LLAMA3_70B, manifest_with_model, write_hf_shaped_folder
from tests.router.test_tls import _issue, _write

CRD = Path(__file__).parent / "schemas" / "kuberay" / "ray.io_rayclusters.yaml"  # source: its README.md
KUBE_VERSIONS = ("1.27.0", "1.37.0")  # the chart's kubeVersion floor, and the newest kubernetes-validate knows
CORE_GROUPS = ("v1", "apps/", "policy/", "networking.k8s.io/", "batch/", "autoscaling/", "rbac.authorization.k8s.io/")


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def value_set(request) -> tuple[str, list[dict]]:
    return request.param, render(values_of(request.param))


def test_the_ci_value_sets_are_the_three_the_docs_name():
    assert set(VALUE_SETS) == {"default", "cpu-demo", "gpu-one-node", "gpu-multi-node"}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_the_chart_lints_clean(name):
    report = helm.lint(CHART, values_of(name), strict=True, kube_version=f"v{KUBE_VERSIONS[-1]}")
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [], problems


# -- schemas -----------------------------------------------------------------------------------------------------

def assert_valid(obj: dict, version: str, what: str) -> None:
    """obj is a valid object of its kind on Kubernetes version (strict: no field the API does not define)."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{what} on Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")


def test_the_kubernetes_check_catches_a_wrong_object():
    service = one(render(None), "Service")
    bad = copy.deepcopy(service)
    bad["spec"]["ports"][0]["targetport"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[-1], strict=True)

def test_every_core_object_validates_against_kubernetes(value_set):
    name, objects = value_set
    core = [o for o in objects if o["apiVersion"].startswith(CORE_GROUPS)]
    assert {o["kind"] for o in core} >= {"ConfigMap", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    for version in KUBE_VERSIONS:
        for obj in core:
            assert_valid(obj, version, f"{name}: {obj['kind']} {obj['metadata']['name']}")


def test_every_pod_template_validates_as_a_pod(value_set):
    """KubeRay copies each group's template into Pods: they must be valid Pods (strict: a misspelled field fails
    here, where the CRD's schema would let it through and the API server would drop it)."""
    name, objects = value_set
    cluster = one(objects, "RayCluster")
    templates = [cluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template.get("metadata", {})},
               "spec": template["spec"]}
        for version in KUBE_VERSIONS:
            assert_valid(pod, version, f"{name}: the pod of {template['metadata']['labels']}")


@functools.cache
def crd_schema() -> dict:
    """The KubeRay CRD's v1 schema (parsed once: the file is large)."""
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def pruned_fields(obj, schema: dict, path: str = "") -> list[str]:
    """The fields of obj that the API server would prune: ones the CRD's structural schema does not declare (the
    object's own metadata is the API server's, not the CRD's)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, value in obj.items():
            if key in props:
                found += [] if path == "" and key == "metadata" else pruned_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += pruned_fields(value, extra, f"{path}.{key}")
            elif extra is not True:
                found.append(f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            found += pruned_fields(item, schema["items"], f"{path}[{i}]")
    return found


def test_the_raycluster_validates_against_the_kuberay_crd(value_set):
    name, objects = value_set
    cluster = one(objects, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    schema = crd_schema()
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(cluster)]
    assert errors == [], f"{name}: {errors}"
    assert pruned_fields(cluster, schema) == [], f"{name}: fields the CRD does not know"


def test_the_raycluster_autoscales_keeps_the_head_free_and_recreates_its_pods_on_upgrade(value_set):
    name, objects = value_set
    spec = one(objects, "RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True  # the controller's request_resources becomes pods
    assert spec["upgradeStrategy"] == {"type": "Recreate"}  # tandem up reads its manifest once
    head = spec["headGroupSpec"]["rayStartParams"]
    assert (head["num-cpus"], head["num-gpus"], head["dashboard-host"]) == ("0", "0", "127.0.0.1")
    assert "resources" not in head  # no tandem_<pool>: no replica lands on the head


def test_the_crd_checks_catch_a_wrong_raycluster():
    """The two checks above can fail: a wrong type, and a field the CRD does not have."""
    cluster = one(render(None), "RayCluster")
    bad = copy.deepcopy(cluster)
    bad["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "many"
    assert list(jsonschema.Draft7Validator(crd_schema()).iter_errors(bad))
    bad = copy.deepcopy(cluster)
    bad["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert pruned_fields(bad, crd_schema()) == [".spec.workerGroupSpecs[0].maxReplica"]


# -- the manifest in the ConfigMap -------------------------------------------------------------------------------

def as_local_files(text: str, tmp_path: Path, tokenizer) -> Path:
    """The ConfigMap's manifest as `tandem up` sees it in the control pod, with this machine's stand-ins for the
    pod's files: a model folder shaped like the one named (config and tokenizer, no weights), the API key files
    and the TLS PEM files the Secrets mount under /etc/tandem."""
    etc = tmp_path / "etc"
    manifest = yaml.safe_load(text)
    model = manifest["model"]
    if model != "embedded":
        config = LLAMA3_70B if "70B" in model else LLAMA3_8B
        folder = write_hf_shaped_folder(tmp_path / Path(model).name, config, tokenizer)
        text = manifest_with_model(text, folder)
    for entry in manifest.get("auth", {}).get("api_keys", []):
        path = etc / Path(entry["key_file"]).relative_to("/etc/tandem")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"sk-{entry['tenant']}-0123456789abcdef\n")
    if "tls" in manifest:
        (etc / "tls").mkdir(parents=True)
        ca = _issue("tandem CA", None, ca=True)
        server = _issue("router", ca, hosts=(f"{RELEASE}-tandem.{NAMESPACE}",))
        cert, key = _write(etc / "tls", "server", server)
        Path(cert).rename(etc / "tls" / "tls.crt")
        Path(key).rename(etc / "tls" / "tls.key")
        Path(_write(etc / "tls", "ca", ca)[0]).rename(etc / "tls" / "ca.crt")
    path = tmp_path / "manifest.yaml"
    path.write_text(text.replace("/etc/tandem/", f"{etc}/"))
    return path


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_the_configmap_manifest_passes_tandem_validate(name, tmp_path, embedded_shape, embedded_shape_once):
    values = merged(name)
    objects = render(values_of(name))
    manifest = validate_file(as_local_files(manifest_text(objects), tmp_path, embedded_shape.tokenizer),
                             check_ports=False)
    assert manifest.ray.address == "auto"
    assert (manifest.listen.grpc, manifest.listen.http) == ("0.0.0.0:50051", "0.0.0.0:8000")
    assert manifest.mode == values["mode"]
    for pool_name, pool in manifest.pool_items():
        given = values["pools"][pool_name]
        split = pool.parallelism
        assert (split.tp, split.pp, split.ep) == tuple(given["parallelism"].get(k, 1) for k in ("tp", "pp", "ep"))
        assert (pool.replicas.min, pool.replicas.max) == (given["replicas"]["min"], given["replicas"]["max"])
        assert pool.resources.custom == {f"tandem_{pool_name}": 1}
        assert pool.resources.gpus == given["resources"]["gpus"]
        assert pool.device == ("cuda" if given["resources"]["gpus"] else "cpu")
    tenants = [e["tenant"] for e in values["auth"]["apiKeys"]] + list(values["auth"].get("tenantNames", []))
    assert [k.tenant for k in manifest.auth.api_keys] == tenants
    assert (manifest.tls is not None) == values["tls"]["enabled"]


def test_every_pool_has_a_node_group_that_offers_what_its_replicas_ask(value_set):
    """The manifest's ranks ask for tandem_<pool>, GPUs and CPUs; one replica (all its ranks, one placement-group
    bundle) must fit one pod of a group that offers tandem_<pool>, and the group must reach replicas.max."""
    name, objects = value_set
    manifest = yaml.safe_load(manifest_text(objects))
    groups = one(objects, "RayCluster")["spec"]["workerGroupSpecs"]
    for pool_name, pool in manifest["pools"].items():
        resource = f"tandem_{pool_name}"
        holders = [g for g in groups if resource in ray_offers(g)]
        assert len(holders) == 1, f"{name}: {resource} offered by {[g['groupName'] for g in holders]}"
        group, offers = holders[0], ray_offers(holders[0])
        ranks = math.prod(pool["parallelism"].get(k, 1) for k in ("tp", "pp", "ep"))
        need = {"CPU": ranks * pool["resources"]["cpus"], "GPU": ranks * pool["resources"]["gpus"], resource: ranks}
        per_pod = min(int(offers[k] // v) for k, v in need.items() if v)
        assert per_pod >= 1, f"{name}: one {pool_name} replica needs {need}; a {group['groupName']} pod offers {offers}"
        assert group["maxReplicas"] * per_pod >= pool["replicas"]["max"], f"{name}: {group['groupName']} too small"
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


# -- what the objects promise ------------------------------------------------------------------------------------

def test_probes_check_the_served_model_and_the_router(value_set):
    name, objects = value_set
    tls = merged(name)["tls"]["enabled"]
    tandem = next(c for c in control_pod(objects)["spec"]["containers"] if c["name"] == "tandem")
    scheme = "HTTPS" if tls else "HTTP"
    assert tandem["startupProbe"]["httpGet"] == {"path": "/health", "port": "http", "scheme": scheme}
    assert tandem["startupProbe"]["failureThreshold"] * tandem["startupProbe"]["periodSeconds"] >= 600
    assert tandem["readinessProbe"]["httpGet"]["path"] == "/health"
    liveness = tandem["livenessProbe"]
    assert liveness == liveness | ({"tcpSocket": {"port": "grpc"}} if tls else
                                   {"grpc": {"port": 50051, "service": "liveness"}})  # SERVING while draining
    assert {p["name"]: p["containerPort"] for p in tandem["ports"]} == {"grpc": 50051, "http": 8000}
    assert "tandem up /etc/tandem/manifest/manifest.yaml" in tandem["args"][0]


def test_the_control_pod_waits_for_the_router_to_drain(value_set):
    """SIGTERM drains the router (router.drain_timeout_s) after preStop's pause: the grace period covers both and
    the stop that follows."""
    name, objects = value_set
    values = merged(name)
    pod = control_pod(objects)["spec"]
    tandem = next(c for c in pod["containers"] if c["name"] == "tandem")
    pause = values["control"]["preStopSeconds"]
    assert tandem["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pause)]
    drain = values["router"].get("drain_timeout_s", 30)
    assert pod["terminationGracePeriodSeconds"] >= pause + drain + 30


def test_a_longer_drain_gets_a_longer_grace_period():
    objects = render(with_("router", {"drain_timeout_s": 300}))
    assert "drain_timeout_s: 300" in manifest_text(objects)
    assert control_pod(objects)["spec"]["terminationGracePeriodSeconds"] >= 5 + 300 + 30


def test_every_ray_container_runs_with_token_authentication_from_the_secret(value_set):
    """Ray's ports run code for whoever reaches them: every Ray container (head, control, workers) has
    RAY_AUTH_MODE=token and its token from the release's Secret, never a literal in the manifests."""
    name, objects = value_set
    secret = one(objects, "Secret", f"{RELEASE}-tandem-ray-auth")
    assert len(base64.b64decode(secret["data"]["auth_token"])) == 64
    cluster = one(objects, "RayCluster")
    templates = [cluster["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in
                                                                  cluster["spec"]["workerGroupSpecs"]]
    containers = [c for t in templates for c in t["spec"]["containers"]]
    assert len(containers) >= 3
    for container in containers:
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                                      "key": "auth_token"}
    off = render(with_("rayAuth", {"enabled": False}))
    assert not [o for o in off if o["kind"] == "Secret" and o["metadata"]["name"].endswith("ray-auth")]
    mine = render(with_("rayAuth", {"existingSecret": "my-ray-token"}))
    env = {e["name"]: e for e in control_pod(mine)["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-ray-token"


def test_every_container_has_requests_and_limits_and_runs_as_no_root(value_set):
    name, objects = value_set
    cluster = one(objects, "RayCluster")["spec"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    containers = [c for t in templates for c in t["spec"]["containers"]] + [cluster["autoscalerOptions"]]
    for container in containers:
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), (name, container.get("name"))
        assert {"cpu", "memory"} <= set(container["resources"]["limits"]), (name, container.get("name"))
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
    for template in templates:
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        assert template["spec"]["securityContext"]["runAsUser"] != 0


def test_the_service_reaches_the_router_on_the_control_pod(value_set):
    name, objects = value_set
    service = one(objects, "Service")
    pod_labels = control_pod(objects)["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"grpc": "grpc", "http": "http"}
    head_labels = one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= head_labels.items()


def test_the_network_policy_lets_only_the_router_ports_in_from_outside(value_set):
    name, objects = value_set
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    release = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": RELEASE}
    internal = one(policies, "NetworkPolicy", f"{RELEASE}-tandem-internal")["spec"]
    assert internal["podSelector"]["matchLabels"] == release
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": release}}]}]
    router = one(policies, "NetworkPolicy", f"{RELEASE}-tandem-router")["spec"]
    assert router["podSelector"]["matchLabels"] == release | {"app.kubernetes.io/component": "control"}
    [rule] = router["ingress"]
    assert sorted(p["port"] for p in rule["ports"]) == [8000, 50051]
    assert rule.get("from", []) == merged(name)["networkPolicy"]["clients"]
    # No rule anywhere opens a port beyond the router's to peers outside the release.
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            outside = [peer for peer in rule.get("from", [{}]) if peer.get("podSelector", {}).get("matchLabels") != release]
            if outside:
                assert sorted(p["port"] for p in rule.get("ports", [])) == [8000, 50051], policy["metadata"]["name"]


def test_pod_disruption_budgets_cover_every_node_group(value_set):
    name, objects = value_set
    groups = [g for g in one(objects, "RayCluster")["spec"]["workerGroupSpecs"] if g["groupName"] != "control"]
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert len(budgets) == len(groups)
    for group in groups:
        labels = group["template"]["metadata"]["labels"]
        assert any(b["spec"]["selector"]["matchLabels"].items() <= labels.items() for b in budgets), group["groupName"]


def test_the_service_monitor_scrapes_the_router_metrics():
    objects = render(values_of("gpu-multi-node"))
    monitor = one(objects, "ServiceMonitor")
    service = one(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["scheme"]) == ("http", "/metrics", "https")
    assert not [o for o in render(None) if o["kind"] == "ServiceMonitor"]


def test_api_keys_and_tls_come_from_secrets_mounted_where_the_manifest_reads_them():
    objects = render(values_of("gpu-one-node"))
    secret = one(objects, "Secret", f"{RELEASE}-tandem-api-keys")
    assert secret["stringData"] == {"default": "sk-demo-0123456789abcdef"}
    volumes = {v["name"]: v for v in control_pod(objects)["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == secret["metadata"]["name"]
    multi = render(values_of("gpu-multi-node"))
    # existingSecret and tls.secretName: made beforehand (only Ray's token is the chart's)
    assert [o["metadata"]["name"] for o in multi if o["kind"] == "Secret"] == [f"{RELEASE}-tandem-ray-auth"]
    volumes = {v["name"]: v for v in control_pod(multi)["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "tandem-api-keys"
    assert volumes["tls"]["secret"]["secretName"] == "tandem-router-tls"
    for container in control_pod(multi)["spec"]["containers"]:  # the router (ray-worker) and `tandem up` both read them
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert (mounts["api-keys"], mounts["tls"]) == ("/etc/tandem/api-keys", "/etc/tandem/tls")


def test_the_cpu_demo_mounts_no_model_and_the_gpu_sets_mount_theirs_read_only():
    demo = render(values_of("cpu-demo"))
    assert "model" not in {v["name"] for v in control_pod(demo)["spec"]["volumes"]}
    assert re.search(r"(?m)^model: embedded$", manifest_text(demo))
    for name in ("default", "gpu-one-node", "gpu-multi-node"):
        objects = render(values_of(name))
        for group in one(objects, "RayCluster")["spec"]["workerGroupSpecs"]:
            mounts = {m["name"]: m for m in group["template"]["spec"]["containers"][0]["volumeMounts"]}
            assert mounts["model"]["readOnly"] is True and mounts["model"]["mountPath"] == "/models"


# -- bad values fail the install ---------------------------------------------------------------------------------

def with_(path: str, value):
    """A values override setting the dotted path to value."""
    override: dict = {}
    node = override
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return override


BAD_VALUES = [
    (with_("pools.decode.parallelism", {"tp": 16, "pp": 1}),
     "pools.decode: one replica is tp x pp x ep = 16 ranks on one node"),
    (with_("model.path", None), "missing property 'path'"),
    (with_("model.path", ""), "/model/path"),
    (with_("pools.prefill.replicas", {"min": -1, "max": 2}), "/pools/prefill/replicas/min"),
    (with_("pools.decode.replicas", {"min": 3, "max": 2}), "pools.decode.replicas: min (3) is more than max (2)"),
    (with_("pools.decode.paralelism", {"tp": 2}), "additional properties 'paralelism' not allowed"),
    (with_("image.variant", "rocm"), "/image/variant"),
    (with_("model.path", "embedded"), "model.path is embedded, which only the cpu image carries"),
    (with_("model.volume", None), "model.volume is empty"),
    (with_("model.path", "/data/llama"), 'model.path "/data/llama" is not inside model.mountPath'),
    (with_("pools.decode.nodeGroup", "decoder"), 'pools.decode.nodeGroup is "decoder", which nodeGroups does not define'),
    (with_("image.variant", "cpu"), "pools.prefill.resources.gpus is 1 but image.variant is cpu"),
    (with_("mode", "colocated"), "mode is colocated"),
    (with_("nodeGroups.decode.gpus", -8), "/nodeGroups/decode/gpus"),
    (with_("tls.enabled", True), "tls.enabled needs tls.secretName"),
    ({"auth": {"apiKeys": [{"tenant": "a", "key": "sk-0123456789abcdef"}], "existingSecret": "keys"}},
     "give API keys one way"),
    (with_("auth.apiKeys", [{"tenant": "a", "key": "short"}]), "/auth/apiKeys/0/key"),
    (with_("auth.tenants", {"ghost": {"max_requests": 1}}), 'auth.tenants names "ghost"'),
]


@pytest.mark.parametrize("override, message", BAD_VALUES, ids=[m[:40] for _, m in BAD_VALUES])
def test_bad_values_fail_the_install_with_their_message(override, message):
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as caught:
        render(override)
    assert message in str(caught.value)
