"""deploy/: the Dockerfiles install kvserve the way the README does, the compose stack
and the Kubernetes manifests hang together and validate against the Kubernetes OpenAPI
schemas, offline.

Docker cannot run on this machine (no daemon): the Dockerfiles are checked by reading
them, never built here. Kubernetes objects:
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
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from server.cli import build_parser

# the dev extra's (as kubernetes-validate below); a machine given the runtime alone has not
jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # oldest supported upstream release we target, newest
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


# ---- install steps: README == Makefile == Dockerfiles (modulo documented differences) -----

@dataclass
class Step:
    kind: str  # "venv" | "pip"
    reqs: list[str] = field(default_factory=list)
    editable: bool = False
    index_url: str | None = None
    upgrade: bool = False

    @property
    def torch(self) -> str | None:
        return next((r for r in self.reqs if re.match(r"torch(\W|$)", r)), None)

    @property
    def project(self) -> tuple[str, frozenset[str]] | None:
        """('.', extras) when this installs kvserve from the source tree."""
        for r in self.reqs:
            m = re.fullmatch(r"(\.)(?:\[([\w,\s]*)\])?", r)
            if m:
                return ".", frozenset(x.strip() for x in (m[2] or "").split(",") if x.strip())
        return None


def parse_command(cmd: str, variables: dict[str, str]) -> Step | None:
    for k, v in variables.items():
        cmd = cmd.replace(f"$({k})", v).replace(f"${{{k}}}", v).replace(f"${k}", v)
    words = shlex.split(cmd, comments=True)
    if not words:
        return None
    if "venv" in words and "-m" in words:
        return Step("venv")
    if "pip" not in words or "install" not in words:
        return None
    step = Step("pip")
    args = words[words.index("install") + 1:]
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-e", "--editable"):
            step.editable = True
        elif a in ("-q", "--quiet", "--no-cache-dir"):
            pass
        elif a in ("-U", "--upgrade"):
            step.upgrade = True
        elif a in ("--index-url", "-i"):
            i += 1
            step.index_url = args[i]
        elif a.startswith("--index-url="):
            step.index_url = a.split("=", 1)[1]
        elif a.startswith("-"):
            raise AssertionError(f"unexpected pip option {a!r} in {cmd!r}")
        else:
            step.reqs.append(a)
        i += 1
    if step.upgrade and step.reqs == ["pip"]:
        return None  # upgrading pip itself is not an install step
    return step


def steps_of(commands: list[str], variables: dict[str, str]) -> list[Step]:
    out = []
    for c in commands:
        for part in re.split(r"&&|;", c):
            s = parse_command(part.strip(), variables)
            if s:
                out.append(s)
    return out


def readme_install() -> tuple[list[Step], list[Step]]:
    """(CPU steps from the Install code block, GPU steps from the GPU paragraph)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README Install has no bash block"
    cpu = steps_of(block[1].splitlines(), {})
    after = section[block.end():]
    gpu = steps_of(re.findall(r"`([^`]*pip install[^`]*)`", after), {})
    return cpu, gpu


def makefile_install() -> list[Step]:
    text = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+)\s*\?=\s*(\S+)", text, re.M))
    # the runtime stamp: what `make serve` installs (`make test` adds the dev extra on top)
    recipe = re.search(r"^\$\(RUNTIME\):.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "Makefile: no $(RUNTIME) recipe"
    lines = [line.strip().replace("$(PY) -m pip", "pip").replace("$(VENV)", ".venv")
             for line in recipe[1].splitlines()]
    lines = [re.sub(r"^test -x \S+ \|\| ", "", line) for line in lines]
    return steps_of(lines, variables)


@cache
def dockerfile(name: str) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """([(INSTRUCTION, arguments)], ARG defaults), continuation lines joined."""
    text = (DEPLOY / name).read_text()
    joined = re.sub(r"\\\n\s*", " ", text)
    instructions = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    args = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    return instructions, args


def docker_steps(name: str) -> list[Step]:
    instructions, args = dockerfile(name)
    return steps_of([rest for word, rest in instructions if word == "RUN"], args)


def test_readme_and_makefile_install_the_same_way() -> None:
    cpu, _ = readme_install()
    make = makefile_install()
    assert [s.kind for s in cpu] == [s.kind for s in make] == ["venv", "pip", "pip"]
    for r, m in zip(cpu, make):
        assert (r.reqs, r.editable, r.index_url) == (m.reqs, m.editable, m.index_url)


def test_cpu_dockerfile_installs_like_the_readme() -> None:
    readme, _ = readme_install()
    docker = docker_steps("Dockerfile")
    assert [s.kind for s in docker] == ["venv", "pip", "pip"], docker
    torch_pin = readme[1].torch
    assert torch_pin and readme[1].reqs == [torch_pin], "README: torch alone, first"
    # step 2: torch first, alone, the same pin; from the PyTorch CPU index, because the
    # image has no local wheel and PyPI's default Linux torch is the CUDA build
    assert docker[1].reqs == [torch_pin]
    assert docker[1].index_url == CPU_TORCH_INDEX
    # step 3: kvserve from the source tree with the same torch pin, so pip keeps torch;
    # runtime only in both; the image drops `-e` (documented in docs/deploy.md)
    assert readme[2].torch == torch_pin and docker[2].torch == torch_pin
    assert readme[2].project == (".", frozenset()) and readme[2].editable
    assert docker[2].project == (".", frozenset())
    assert not docker[2].editable and docker[2].index_url is None
    assert len(docker[2].reqs) == len(readme[2].reqs) == 2


def test_cuda_dockerfile_installs_like_the_readme_gpu_recipe() -> None:
    readme_cpu, gpu = readme_install()
    assert [s.kind for s in gpu] == ["pip", "pip"], gpu
    docker = docker_steps("Dockerfile.cuda")
    assert [s.kind for s in docker] == ["venv", "pip", "pip"], docker
    # the CUDA torch first, from the README's CUDA index; the image pins the version the
    # CPU recipe pins (the README leaves it to the user)
    assert gpu[0].torch == "torch" and gpu[0].index_url
    assert docker[1].reqs == [readme_cpu[1].torch]
    assert docker[1].index_url == gpu[0].index_url
    # then kvserve with the `gpu` extra (Triton), torch kept as is
    assert gpu[1].project == (".", frozenset({"gpu"}))
    assert docker[2].project == (".", frozenset({"gpu"}))
    assert docker[2].torch == readme_cpu[1].torch


def test_deploy_doc_states_the_image_differences_and_that_docker_was_not_run() -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for needed in (CPU_TORCH_INDEX, "cu128", "`-e`", "`dev` extra", "Docker cannot run"):
        assert needed in doc, needed


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_runtime_setup(name: str) -> None:
    instructions, _ = dockerfile(name)
    last = {}
    for word, rest in instructions:
        last[word] = rest
    user = last["USER"].split(":")[0]
    assert user not in ("0", "root"), "runs as root"
    assert "/health" in last["HEALTHCHECK"]
    assert "/models" in last["VOLUME"]
    assert last["EXPOSE"] == "8000"
    assert json.loads(last["ENTRYPOINT"]) == ["kvserve"]
    cmd = json.loads(last["CMD"])
    args = build_parser().parse_args(cmd)  # the default command is valid kvserve usage
    assert args.command == "serve" and args.model is None, "the demo model is the default"
    assert args.host == "0.0.0.0" and args.port == 8000
    assert [i for i, (w, _) in enumerate(instructions) if w == "USER"][-1] > max(
        i for i, (w, _) in enumerate(instructions) if w == "RUN"), "installs run before USER"
    # every package the wheel includes is copied in and not excluded by the dockerignore
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.findall(r'"(\w+)\*"', pyproject.split("[tool.setuptools]", 1)[1])
    copied = {src for w, rest in instructions if w == "COPY" for src in rest.split()[:-1]
              if not src.startswith("--")}
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    for p in packages:
        assert p in copied, f"{p} is not copied into the image"
        assert f"!{p}/" in ignore, f"{p} is excluded by {name}.dockerignore"
    for f in ("pyproject.toml", "README.md"):
        assert f in copied and f"!{f}" in ignore


# ---- docker compose ----------------------------------------------------------------------

def load_yaml(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def test_compose_stack_is_wired() -> None:
    (compose,) = load_yaml(DEPLOY / "docker-compose.yml")
    s = compose["services"]
    assert set(s) == {"kvserve", "prometheus", "grafana"}
    kv = s["kvserve"]
    assert kv["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (DEPLOY / kv["build"]["context"] / kv["build"]["dockerfile"]).is_file()
    args = build_parser().parse_args(kv["command"])
    assert args.command == "serve" and args.metrics_alias == "vllm" and args.port == 8000
    assert any(v.endswith(":/models:ro") for v in kv["volumes"])
    for svc in s.values():  # published on loopback only
        for p in svc.get("ports", []):
            assert p.startswith("127.0.0.1:"), p
    # Prometheus: the mounted config scrapes the kvserve service and loads the rules
    prom_mounts = dict(v.split(":")[:2] for v in s["prometheus"]["volumes"])
    host_dir = DEPLOY / next(h for h, c in prom_mounts.items() if c == "/etc/prometheus")
    (config,) = load_yaml(host_dir / "prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["kvserve:8000"]
    assert job["job_name"] == "kvserve" and job["static_configs"][0]["labels"]["model"]
    for rules in config["rule_files"]:
        assert (host_dir / rules).is_file()
    # Grafana: provisioned datasource -> the prometheus service; dashboards from the mount
    graf = {c: DEPLOY / h for h, c in (v.split(":")[:2] for v in s["grafana"]["volumes"])
            if h.startswith("./")}
    prov = graf["/etc/grafana/provisioning"]
    (ds,) = load_yaml(prov / "datasources" / "prometheus.yml")
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    assert ds["datasources"][0]["type"] == "prometheus"
    (dash,) = load_yaml(prov / "dashboards" / "kvserve.yml")
    dash_dir = dash["providers"][0]["options"]["path"]
    assert (graf[dash_dir] / "kvserve.json").is_file()


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
