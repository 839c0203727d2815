"""deploy/kubernetes: the manifests hang together and validate against the Kubernetes
OpenAPI schemas, offline (the Dockerfiles and the compose stack: tests/test_deploy.py).

Kubernetes objects:
- core kinds (Deployment, Service, PodDisruptionBudget, Namespace, RBAC, ...) against the
  Kubernetes OpenAPI JSON schemas bundled by the `kubernetes-validate` package, strict
  (unknown fields are errors);
- ServiceMonitor, PrometheusRule (Prometheus Operator) and ScaledObject (KEDA) against
  JSON schemas derived from their published CRDs, as packaged by `cloudcoil-models-*`
  (pydantic models generated from the CRDs), made strict the same way;
- InferencePool, Gateway and HTTPRoute (Gateway API / Inference Extension): no PyPI
  package carries their CRD schemas, so their apiVersion, kind and required fields are
  checked here by hand, with the references between objects.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

from server.cli import build_parser
from tests.test_deploy import dockerfile, load_yaml

# the dev extra's (as kubernetes-validate below); a machine given the runtime alone has not
jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # oldest supported upstream release we target, newest


# ---- Kubernetes --------------------------------------------------------------------------

def manifests() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.name.endswith("-values.yaml"):
            continue
        out.extend((path, d) for d in load_yaml(path))
    return out


def by_kind(kind: str) -> list[tuple[Path, dict]]:
    return [(p, d) for p, d in manifests() if d["kind"] == kind]


def strict(schema: dict) -> dict:
    """Forbid unknown fields in every object schema that lists its properties. Go regexes
    put inline flags anywhere (`^(?i)...`), Python only first: move them."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            if isinstance(node.get("pattern"), str) and "(?i)" in node["pattern"]:
                node["pattern"] = "(?i)" + node["pattern"].replace("(?i)", "")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> strict JSON schema from the CRD-generated cloudcoil models."""
    from cloudcoil.models.keda.v1alpha1 import ScaledObject
    from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor

    return {("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
            ("monitoring.coreos.com/v1", "PrometheusRule"): PrometheusRule,
            ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject}


def gateway_api_check(doc: dict) -> None:
    """Gateway API / Inference Extension objects: required fields by hand (no schemas)."""
    kind, spec = doc["kind"], doc["spec"]
    assert doc["metadata"]["name"]
    if kind == "InferencePool":
        assert doc["apiVersion"] == "inference.networking.k8s.io/v1"
        assert spec["selector"]["matchLabels"]
        assert all(1 <= p["number"] <= 65535 for p in spec["targetPorts"])
        ref = spec["endpointPickerRef"]
        assert ref["name"] and 1 <= ref["port"]["number"] <= 65535
        assert ref.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
        assert set(spec) <= {"selector", "targetPorts", "endpointPickerRef"}
    elif kind == "HTTPRoute":
        assert doc["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert spec["parentRefs"] and all(r["name"] for r in spec["parentRefs"])
        for rule in spec["rules"]:
            for ref in rule["backendRefs"]:
                assert ref["name"]
    elif kind == "Gateway":
        assert doc["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert spec["gatewayClassName"]
        for listener in spec["listeners"]:
            assert listener["name"] and listener["protocol"] and listener["port"]
    else:
        raise AssertionError(f"no check for {kind}")


GATEWAY_KINDS = {"InferencePool", "HTTPRoute", "Gateway"}


def test_every_manifest_validates_offline() -> None:
    import kubernetes_validate

    seen = set()
    for path, doc in manifests():
        where = f"{path.relative_to(ROOT)} {doc['kind']}/{doc['metadata']['name']}"
        seen.add(doc["kind"])
        key = (doc["apiVersion"], doc["kind"])
        if key in crd_schemas():
            schema = crd_schemas()[key].model_json_schema(by_alias=True)
            try:
                jsonschema.validate(doc, strict(schema))
            except jsonschema.ValidationError as e:
                raise AssertionError(f"{where}: {e.message} at {list(e.absolute_path)}") from e
        elif doc["kind"] in GATEWAY_KINDS:
            gateway_api_check(doc)
        else:
            for version in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    raise AssertionError(f"{where} (k8s {version}): {e.message} at "
                                         f"{list(e.absolute_path)}") from e
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule",
            "ScaledObject", "InferencePool", "HTTPRoute"} <= seen


def test_strict_validation_catches_mistakes() -> None:
    """The validators used above do reject a typo, in a core kind and in a CRD."""
    import kubernetes_validate

    (_, dep), = [(p, d) for p, d in by_kind("Deployment") if "cpu" in p.parts]
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/ready"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    (_, so), = by_kind("ScaledObject")
    bad = copy.deepcopy(so)
    bad["spec"]["maxReplicas"] = 3
    schema = strict(crd_schemas()[("keda.sh/v1alpha1", "ScaledObject")]
                    .model_json_schema(by_alias=True))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_kustomizations_reference_existing_files_and_cover_the_manifests() -> None:
    referenced = set()
    for k in K8S.rglob("kustomization.yaml"):
        (doc,) = load_yaml(k)
        assert doc["kind"] == "Kustomization"
        for r in doc["resources"]:
            target = (k.parent / r).resolve()
            assert target.exists(), f"{k}: {r}"
            referenced.add(target)
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file()
    unreferenced = {p.resolve() for p, _ in manifests()} - referenced
    # the InferencePool is normally created by the upstream Helm chart; this copy is for
    # installs that deploy the endpoint picker by hand (docs/deploy.md)
    assert unreferenced == {(K8S / "router/inference-gateway/inferencepool.yaml").resolve()}


def pod_labels(dep: dict) -> dict:
    return dep["spec"]["template"]["metadata"]["labels"]


def test_deployments_serve_with_probes_drain_and_the_vllm_alias() -> None:
    deps = {p.parent.name: d for p, d in by_kind("Deployment") if p.parent.name in ("cpu", "gpu")}
    assert set(deps) == {"cpu", "gpu"}
    for variant, dep in deps.items():
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        args = build_parser().parse_args([a.split("  #")[0] for a in c["args"]])
        assert args.command == "serve" and args.metrics_alias == "vllm"
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
        assert args.port == port and args.host == "0.0.0.0"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] > sleep + args.drain_timeout
        assert pod["securityContext"]["runAsNonRoot"]
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels(dep).items()
        assert "/models" in {m["mountPath"] for m in c["volumeMounts"]}
        if variant == "gpu":
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert args.device == "cuda" and c["image"].endswith(":cuda")
        else:
            assert "nvidia.com/gpu" not in c["resources"]["limits"]
            assert c["image"].endswith(":cpu")


def test_runs_as_the_image_user() -> None:
    for name, variant in (("Dockerfile", "cpu"), ("Dockerfile.cuda", "gpu")):
        instructions, _ = dockerfile(name)
        uid = [rest for w, rest in instructions if w == "USER"][-1].split(":")[0]
        (dep,) = [d for p, d in by_kind("Deployment") if p.parent.name == variant]
        assert str(dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"]) == uid


def test_objects_reference_each_other() -> None:
    deps = [d for p, d in by_kind("Deployment") if p.parent.name in ("cpu", "gpu")]
    (svc,) = [d for _, d in by_kind("Service") if d["metadata"]["name"] == "kvserve"]
    for dep in deps:
        assert svc["spec"]["selector"].items() <= pod_labels(dep).items()
        assert dep["metadata"]["name"] == "kvserve"
    (_, pdb), = by_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(deps[0]).items()
    # ServiceMonitor -> Service port; the model label comes from a pod label
    (_, sm), = by_kind("ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep["path"] == "/metrics"
    (relabel,) = [r for r in ep["relabelings"] if r["targetLabel"] == "model"]
    (source,) = relabel["sourceLabels"]
    pod_label = next(k for k in pod_labels(deps[0]) if
                     "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k) == source)
    assert all(pod_label in pod_labels(d) for d in deps)
    # ScaledObject -> Deployment; its queries select what the Operator labels series with
    # (job = the Service name, namespace)
    (_, so), = by_kind("ScaledObject")
    assert so["spec"]["scaleTargetRef"]["name"] == "kvserve"
    assert so["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    for t in so["spec"]["triggers"]:
        q = t["metadata"]["query"]
        assert f'job="{svc["metadata"]["name"]}"' in q
        assert f'namespace="{svc["metadata"]["namespace"]}"' in q
        float(t["metadata"]["threshold"])
    # InferencePool -> kvserve pods; HTTPRoute -> InferencePool and Gateway
    (_, pool), = by_kind("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels(deps[0]).items()
    port = deps[0]["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    (values,) = load_yaml(K8S / "router/inference-gateway/inferencepool-values.yaml")
    ip = values["inferencePool"]
    assert ip["modelServers"]["matchLabels"] == pool["spec"]["selector"]["matchLabels"]
    assert ip["modelServerType"] == "vllm" and ip["targetPorts"] == pool["spec"]["targetPorts"]
    (_, route), = by_kind("HTTPRoute")
    (_, gw), = by_kind("Gateway")
    assert route["spec"]["parentRefs"][0]["name"] == gw["metadata"]["name"]
    (ref,) = route["spec"]["rules"][0]["backendRefs"]
    assert (ref["group"], ref["kind"], ref["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    # production-stack router: discovers the kvserve pods by label on their port
    (router,) = [d for p, d in by_kind("Deployment") if d["metadata"]["name"] == "kvserve-router"]
    rargs = dict(a.lstrip("-").split("=", 1)
                 for a in router["spec"]["template"]["spec"]["containers"][0]["args"])
    selector = dict(kv.split("=") for kv in rargs["k8s-label-selector"].split(","))
    assert selector.items() <= pod_labels(deps[0]).items()
    assert int(rargs["k8s-port"]) == port
    assert rargs["k8s-namespace"] == deps[0]["metadata"]["namespace"]


def test_prometheusrule_carries_the_alert_rules() -> None:
    (_, rule), = by_kind("PrometheusRule")
    (alerts,) = load_yaml(DEPLOY / "prometheus" / "alerts.yml")
    assert rule["spec"]["groups"] == alerts["groups"]


KUSTOMIZE_DIRS = ("cpu", "gpu", "monitoring", "autoscaling", "router/inference-gateway",
                  "router/production-stack")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed "
                    "(optional: the kustomizations are also checked by reading them)")
@pytest.mark.parametrize("directory", KUSTOMIZE_DIRS)
def test_kustomize_renders_offline(directory: str) -> None:
    """`kubectl kustomize` (no cluster needed) renders each entry point to the objects of
    the files it lists."""
    r = subprocess.run(["kubectl", "kustomize", str(K8S / directory)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rendered = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(r.stdout) if d}
    assert rendered and all(k for k, _ in rendered)
    if directory in ("cpu", "gpu"):
        assert rendered == {("Namespace", "kvserve"), ("Service", "kvserve"),
                            ("PodDisruptionBudget", "kvserve"), ("Deployment", "kvserve")}
