"""A real Prometheus scrapes a real kvserve under a short load, and every PromQL
expression we ship returns data through Prometheus's HTTP API.

What is checked, against the files in deploy/ (nothing is copied into this test):
- `promtool check config` / `promtool check rules` accept the Prometheus config and the
  alert rules;
- every panel query of the Grafana dashboard, the `<signal>` side of every alert rule
  (`<signal> <op> <threshold>`), every full alert expression, and every KEDA trigger query
  return at least one series with at least one non-NaN value over the load window;
- Prometheus loaded and evaluated every rule without error;
- the load did what the panels are meant to show (429s, preemptions, kv_policy eviction,
  prefix-cache hits), and the `vllm:` aliases are scraped.

The Prometheus config is deploy/prometheus/prometheus.yml with three test-only changes: a
1 s scrape/evaluation interval, the target (127.0.0.1 and an ephemeral port), and the
target labels the Prometheus Operator adds on Kubernetes (`namespace`, `job` = the
Service name), which the KEDA queries select on. Skipped only when the `prometheus`
binary is missing (CI installs Debian's `prometheus` package, see .ci/run).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig
from server.app import build_app
from server.metrics import add_metrics_alias
from server.settings import ServerSettings
from server.testing import ServerThread
from tests.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvserve.json"
SCALED_OBJECT = DEPLOY / "kubernetes" / "autoscaling" / "scaledobject.yaml"
RATE_INTERVAL = "5s"  # what $__rate_interval becomes here (5 scrapes at 1 s)
PAUSE = 1.5  # seconds between load phases: more than the 1 s scrape interval

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="the `prometheus` binary is not installed (Debian package "
    "`prometheus`; .ci/run installs it)")


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard target, template variables substituted."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            expr = (t["expr"].replace("$__rate_interval", RATE_INTERVAL)
                    .replace("$model", ".*").replace("$instance", ".*"))
            out.append((f"dashboard panel {p['title']!r} {t['refId']}", expr))
    return out


COMPARISON = re.compile(r"^(?P<signal>.*\S)\s*(?P<op>>=|<=|==|!=|>|<)\s*(?P<threshold>[-+0-9.e]+)$",
                        re.S)


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def alert_exprs() -> list[tuple[str, str]]:
    out = []
    for r in alert_rules():
        expr = " ".join(r["expr"].split())
        m = COMPARISON.match(expr)
        assert m, f"alert {r['alert']}: expr is not `<signal> <op> <threshold>`: {expr}"
        out.append((f"alert {r['alert']} (signal)", m["signal"]))
        out.append((f"alert {r['alert']} (full)", expr))
    return out


def keda_exprs() -> list[tuple[str, str]]:
    out = []
    for doc in yaml.safe_load_all(SCALED_OBJECT.read_text()):
        for t in doc["spec"]["triggers"]:
            if t["type"] == "prometheus":
                out.append((f"KEDA trigger {t.get('name', t['metadata']['query'])}",
                            t["metadata"]["query"]))
    return out


def test_promtool_check_config_and_rules(tmp_path: Path) -> None:
    if PROMTOOL is None:
        pytest.skip("`promtool` is not installed (Debian package `prometheus`; .ci/run "
                    "installs it)")
    for args in (["check", "config", str(PROM_CONFIG)], ["check", "rules", str(ALERTS)]):
        r = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    # the PrometheusRule's groups, written out as a rule file, pass too
    rule = yaml.safe_load((DEPLOY / "kubernetes" / "monitoring" / "prometheusrule.yaml")
                          .read_text())
    f = tmp_path / "from-prometheusrule.yml"
    f.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    r = subprocess.run([PROMTOOL, "check", "rules", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlowSteps:
    """A step listener that slows steps down while set, so a burst stays queued long
    enough to hit the queue limit (429) regardless of machine speed."""

    def __init__(self) -> None:
        self.delay = 0.0

    def __call__(self, _stats: object) -> None:
        if self.delay:
            time.sleep(self.delay)


@pytest.fixture(scope="module")
def kvserve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, SlowSteps]]:
    model_dir = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    # 3 layers x 20 blocks of 4 tokens: 80 tokens in all (the byte tokenizer makes a
    # token of each character), so a few ~45-token requests cannot all run to the end
    # together and the newest get preempted.
    engine = AsyncEngine.from_config(
        EngineConfig(model=model_dir, num_blocks=60, block_size=4, max_num_batched_tokens=64),
        max_queued_requests=3)
    slow = SlowSteps()
    engine.add_step_listener(slow)
    app = build_app(engine, ServerSettings(served_model_names=["tiny"], model_path=model_dir))
    add_metrics_alias(app.state.metrics, engine, "vllm", "tiny")
    with ServerThread(app) as s:
        yield s, slow


@pytest.fixture(scope="module")
def prometheus(kvserve: tuple[ServerThread, SlowSteps],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if PROMETHEUS is None:
        pytest.skip("the `prometheus` binary is not installed")
    server, _ = kvserve
    d = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(PROM_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS)]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvserve"]
    (group,) = job["static_configs"]
    group["targets"] = [f"127.0.0.1:{server.port}"]
    group["labels"]["namespace"] = "kvserve"  # what the Prometheus Operator adds
    (d / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = (d / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={d / 'prometheus.yml'}",
         f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--storage.tsdb.retention.time=1h", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=url, timeout=5) as c:
            while True:
                assert proc.poll() is None, (d / "prometheus.log").read_text()
                try:
                    if c.get("/-/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _up(c: httpx.Client) -> bool:
    r = c.get("/api/v1/query", params={"query": 'up{job="kvserve"}'}).json()
    return any(s["value"][1] == "1" for s in r["data"]["result"])


async def _load(url: str, slow: SlowSteps) -> dict[str, int]:
    """A short load that gives every panel something to show: a burst over the queue
    limit (429), concurrent requests that outgrow the pool (preemption), a streaming
    kv_policy with a small window (eviction), a repeated prompt (prefix-cache hits)."""
    statuses: dict[str, int] = {}

    async def one(c: httpx.AsyncClient, body: dict) -> None:
        r = await c.post("/v1/completions", json=body)
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
        assert r.status_code in (200, 429), (body, r.text)

    base = {"max_tokens": 24, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        # The burst arrives while the first steps are slowed down, so more than
        # max_queued_requests (3) wait for a first token at once: 429s. Admission answers
        # at once, so the slowdown only needs to last a moment.
        slow.delay = 0.2
        asyncio.get_running_loop().call_later(1.0, setattr, slow, "delay", 0.0)
        await asyncio.gather(*(one(c, {**base, "prompt": f"burst {i} of requests"})
                               for i in range(6)))
        slow.delay = 0.0
        # Pauses longer than the scrape interval between the phases: the tiny model runs
        # the whole load in well under a second, and a counter series that first appears
        # at its final value has a rate of 0 (so a ratio of two of them is NaN).
        await asyncio.sleep(PAUSE)
        for _ in range(2):  # the same prompt twice: the second hits the prefix cache
            await one(c, {**base, "prompt": "shared prefix, cache me"})
        await asyncio.sleep(PAUSE)
        await one(c, {**base, "max_tokens": 30, "prompt": "evict me: streaming",
                      "kv_policy": {"name": "streaming", "sink": 2, "window": 8}})
        await asyncio.sleep(PAUSE)
        await asyncio.gather(*(one(c, {**base, "prompt": f"wave {i} of requests"})
                               for i in range(3)))
    return statuses


def _query_range(c: httpx.Client, expr: str, start: float, end: float) -> list[dict]:
    r = c.get("/api/v1/query_range", params={"query": expr, "start": start, "end": end,
                                             "step": "1s"})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def _has_value(result: list[dict]) -> bool:
    return any(not math.isnan(float(v)) for s in result for _, v in s["values"])


def _instant(c: httpx.Client, expr: str) -> float:
    body = c.get("/api/v1/query", params={"query": expr}).json()
    assert body["status"] == "success", body
    res = body["data"]["result"]
    return float(res[0]["value"][1]) if res else float("nan")


@needs_prometheus
@pytest.mark.timeout(180)
def test_prometheus_scrapes_kvserve_and_every_shipped_query_returns_data(
        kvserve: tuple[ServerThread, SlowSteps], prometheus: str) -> None:
    server, slow = kvserve
    with httpx.Client(base_url=prometheus, timeout=10) as c:
        deadline = time.monotonic() + 20
        while not _up(c):
            assert time.monotonic() < deadline, "prometheus never scraped kvserve"
            time.sleep(0.25)
        start = time.time()
        statuses = asyncio.run(_load(server.url, slow))
        assert statuses.get("429", 0) >= 1 and statuses.get("200", 0) >= 7, statuses
        time.sleep(4)  # a few more scrapes and rule evaluations after the load
        end = time.time()

        # the load did what the panels are meant to show
        checks = {
            "queue_full rejections": 'sum(kvserve_requests_rejected_total{reason="queue_full"})',
            "HTTP 429": 'sum(kvserve_http_requests_total{status="429"})',
            "preemptions": "sum(kvserve_num_preemptions_total)",
            "streaming evictions": 'sum(kvserve_policy_evicted_tokens_total{policy="streaming"})',
            "prefix-cache hits": "sum(kvserve_prefix_cache_hits_total)",
            "vllm:num_requests_waiting scraped": 'count(vllm:num_requests_waiting{model_name="tiny"}) + 1',
            "vllm:kv_cache_usage_perc scraped": "count(vllm:kv_cache_usage_perc) + 1",
            "vllm:cache_config_info scraped": "count(vllm:cache_config_info) + 1",
        }
        for what, expr in checks.items():
            assert _instant(c, expr) > 0, f"{what}: {expr}"

        # every shipped expression returns data
        exprs = dashboard_exprs() + alert_exprs() + keda_exprs()
        assert len(exprs) > 50
        empty = []
        for where, expr in exprs:
            full_alert = where.endswith("(full)")
            result = _query_range(c, expr, start, end)  # also: Prometheus parses it
            if not full_alert and not _has_value(result):
                empty.append(f"{where}: {expr}")
        # A full alert expression (`signal > threshold`) is empty while the alert does not
        # fire, which is the normal state; its signal side must have data (checked above).
        assert not empty, "expressions without data:\n" + "\n".join(empty)

        # every metric name the shipped queries use is one the server exports
        names = set(c.get("/api/v1/label/__name__/values").json()["data"])
        used = {m for _, e in exprs for m in re.findall(r"\b(kvserve_[a-z0-9_]+|vllm:[a-z0-9_]+)", e)}
        assert used <= names, f"not exported: {sorted(used - names)}"

        # the dashboard's template variables resolve
        models = c.get("/api/v1/label/model/values",
                       params={"match[]": "kvserve_engine_ready"}).json()["data"]
        assert models, "the `model` variable has no values"

        # Prometheus loaded the rules and evaluated each without error
        groups = c.get("/api/v1/rules").json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, bad


def test_every_dashboard_panel_has_queries() -> None:
    dash = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model", "instance"} <= names
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p.get("targets"), p["title"]
        for t in p["targets"]:
            assert '$model' in t["expr"] and '$instance' in t["expr"], (p["title"], t["expr"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for needed in ("finish reason", "time to first token", "tpot", "itl", "end-to-end",
                   "token throughput", "running / waiting / swapped", "blocks by state",
                   "live-slot", "prefix-cache hit", "preemptions by mode", "swap traffic",
                   "evicted tokens by kv_policy", "requests by kv_policy", "step time split",
                   "429"):
        assert needed in titles, needed

