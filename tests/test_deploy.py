"""deploy/: the Dockerfiles install kvserve the way the README does, and the compose stack
hangs together (the Kubernetes manifests: tests/test_deploy_kubernetes.py).

Docker cannot run on this machine (no daemon): the Dockerfiles are checked by reading
them, never built here.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

from server.cli import build_parser

# the dev extra's; a machine given the runtime alone has not
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
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
