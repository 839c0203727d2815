"""Tenants on a real uvicorn (127.0.0.1): several API keys, each its own tenant with a
key-derived prefix-cache salt; `cache_salt`; per-tenant metrics; `--tenant-quota` and
`--api-key` parsing."""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from scheduler.async_engine import AsyncEngine
from scheduler.engine_core import EngineConfig
from server.app import build_app
from server.cli import build_parser, main, tenancy
from server.settings import ServerSettings
from server.tenants import effective_salt, make_tenants, parse_tenant_quotas
from server.testing import ServerThread
from tests.tiny_models import make_tiny_model

MODEL = "tiny"
KEYS = ["key-alpha-0123456789", "key-beta-0123456789"]
ALPHA, BETA = ({"Authorization": f"Bearer {k}"} for k in KEYS)
SLOW = threading.Event()  # while set, every engine step sleeps (to catch a request running)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def _server(model_dir: str, keys: list[str], quotas: dict[str, float] | None = None
            ) -> ServerThread:
    engine = AsyncEngine.from_config(EngineConfig(model=model_dir, num_blocks=512,
                                                  tenant_quotas=quotas))
    engine.add_step_listener(lambda _: SLOW.is_set() and time.sleep(0.02))
    return ServerThread(build_app(engine, ServerSettings(
        served_model_names=[MODEL], model_path=model_dir, api_keys=keys)))


@pytest.fixture(scope="module")
def keyed(model_dir: str) -> Iterator[httpx.Client]:
    with _server(model_dir, KEYS, {"tenant0": 0.5}) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def open_server(model_dir: str) -> Iterator[httpx.Client]:
    with _server(model_dir, []) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        yield c


def long_prompt() -> str:
    """A prompt nobody sent before (~110 byte tokens: six full blocks)."""
    return f"{uuid.uuid4().hex} the quick brown fox jumps over the lazy dog {uuid.uuid4().hex}"


def hits(c: httpx.Client, prompt: str, headers: dict[str, str] | None = None,
         **extra: Any) -> int:
    r = c.post("/v1/completions", headers=headers,
               json={"prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["kv_cache"]["prefix_hit_tokens"]


def chat_hits(c: httpx.Client, content: str, **extra: Any) -> int:
    r = c.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["kv_cache"]["prefix_hit_tokens"]


def gauge(text: str, name: str, tenant: str) -> float | None:
    m = re.search(rf'^{name}{{tenant="{tenant}"}} (\S+)$', text, re.M)
    return None if m is None else float(m.group(1))


# ---- isolation ------------------------------------------------------------------------
def test_keys_are_tenants_with_separate_prefix_caches(keyed: httpx.Client) -> None:
    p = long_prompt()
    assert hits(keyed, p, ALPHA) == 0
    assert hits(keyed, p, BETA) == 0  # alpha's cached prefix is invisible to beta
    assert hits(keyed, p, ALPHA) > 0  # ... but serves alpha again
    assert hits(keyed, p, BETA) > 0  # and beta now has its own copy
    # equal cache_salts do not bridge tenants: the key's salt comes first
    assert hits(keyed, p, ALPHA, cache_salt="shared") == 0
    assert hits(keyed, p, BETA, cache_salt="shared") == 0
    assert hits(keyed, p, ALPHA, cache_salt="shared") > 0


def test_cache_salt_alone_isolates(open_server: httpx.Client) -> None:
    c, p = open_server, long_prompt()
    assert hits(c, p) == 0
    assert hits(c, p, cache_salt="s1") == 0
    assert hits(c, p, cache_salt="s1") > 0
    assert hits(c, p, cache_salt="s2") == 0
    assert hits(c, p) > 0  # the unsalted copy is still there
    q = long_prompt()
    assert chat_hits(c, q, cache_salt="c1") == 0
    assert chat_hits(c, q) == 0
    assert chat_hits(c, q, cache_salt="c1") > 0


@pytest.mark.parametrize("salt", ["", "x" * 257, 5, ["a"]])
def test_cache_salt_validation(open_server: httpx.Client, salt: object) -> None:
    r = open_server.post("/v1/completions", json={"prompt": "x", "cache_salt": salt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_effective_salt() -> None:
    a, b = make_tenants(["ka", "kb"])
    assert effective_salt(None, None) is None and effective_salt(None, "s") == "s"
    assert effective_salt(a, None) == effective_salt(a, "")
    assert effective_salt(a, "s") != effective_salt(b, "s")
    assert "ka" not in effective_salt(a, "s") and "ka" not in repr(a)  # the secret stays


# ---- auth, logs, metrics --------------------------------------------------------------
def test_unknown_key_is_401(keyed: httpx.Client) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"},
                    {"Authorization": f"Basic {KEYS[0]}"},
                    {"Authorization": f"Bearer {KEYS[0]}x"}):
        r = keyed.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert keyed.get("/v1/models", headers=BETA).status_code == 200
    assert keyed.get("/metrics").status_code == 200  # no key needed


def test_request_log_names_the_tenant(keyed: httpx.Client,
                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.request"):
        hits(keyed, "log me", BETA)
        deadline = time.monotonic() + 5
        while not any(getattr(r, "fields", {}).get("tenant") for r in caplog.records):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    fields = [r.fields for r in caplog.records if hasattr(r, "fields")]
    assert fields[-1]["tenant"] == "tenant1"
    assert not any(k in caplog.text for k in KEYS)


def test_tenant_metrics(keyed: httpx.Client) -> None:
    text = keyed.get("/metrics").text
    capacity = 512
    assert gauge(text, "kvserve_tenant_kv_blocks_quota", "tenant0") == capacity / 2
    assert gauge(text, "kvserve_tenant_kv_blocks_quota", "tenant1") == 0
    assert set(re.findall(r'tenant="([^"]*)"', text)) == {"tenant0", "tenant1"}
    assert not any(k in text for k in KEYS)
    body = {"prompt": long_prompt(), "max_tokens": 120, "ignore_eos": True, "stream": True}
    SLOW.set()
    try:
        with keyed.stream("POST", "/v1/completions", json=body, headers=BETA) as r:
            assert r.status_code == 200
            # No waiting for a first line: a random model looping on a UTF-8 lead byte
            # sends no text until it finishes (the detokenizer holds back a trailing
            # U+FFFD), and by then the blocks are gone. The request runs >= 2.4 s.
            deadline = time.monotonic() + 10
            while not gauge(keyed.get("/metrics").text, "kvserve_tenant_kv_blocks",
                            "tenant1"):
                assert time.monotonic() < deadline, "tenant1's blocks never showed"
                time.sleep(0.02)
            assert gauge(keyed.get("/metrics").text, "kvserve_tenant_kv_blocks",
                         "tenant0") == 0
    finally:
        SLOW.clear()
    deadline = time.monotonic() + 10  # the disconnect aborted it: the blocks come back
    while gauge(keyed.get("/metrics").text, "kvserve_tenant_kv_blocks", "tenant1"):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_no_keys_no_tenant_series(open_server: httpx.Client) -> None:
    text = open_server.get("/metrics").text
    assert "# TYPE kvserve_tenant_kv_blocks gauge" in text
    assert "tenant=" not in text


# ---- argument parsing -----------------------------------------------------------------
def _tenancy(argv: list[str]) -> tuple[list[str], dict[str, float]]:
    return tenancy(build_parser().parse_args(["serve", *argv]))


def test_api_keys_and_quotas_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    assert _tenancy([]) == ([], {})
    assert _tenancy(["--api-key", "a", "--api-key", "b", "--tenant-quota", "b=0.25",
                     "--tenant-quota", "tenant0=0.5"]) == (["a", "b"],
                                                           {"tenant1": 0.25, "tenant0": 0.5})
    monkeypatch.setenv("KVSERVE_API_KEY", " k1, k2 ,,k3")
    keys, quotas = _tenancy(["--tenant-quota", "k3=0.75"])
    assert keys == ["k1", "k2", "k3"] and quotas == {"tenant2": 0.75}
    assert _tenancy(["--api-key", "x"])[0] == ["x"]  # the flag wins over the env
    # rounding: 0.1 + 0.2 + 0.7 > 1 in floating point, but is meant as 1
    q = parse_tenant_quotas(["a=0.1", "b=0.2", "c=0.7"], make_tenants(["a", "b", "c"]))
    assert sum(q.values()) <= 1 and q["tenant2"] == pytest.approx(0.7)
    assert ServerSettings(api_key="x", api_keys=["y"]).tenant_names == ["tenant0", "tenant1"]


@pytest.mark.parametrize("argv, message", [
    (["--tenant-quota", "a=0.5"], "needs API keys"),
    (["--api-key", "a", "--api-key", "b", "--tenant-quota", "secret-typo=0.5"],
     "neither one of the 2 API keys"),
    (["--api-key", "a", "--tenant-quota", "a=0"], "in (0, 1]"),
    (["--api-key", "a", "--tenant-quota", "a=1.5"], "in (0, 1]"),
    (["--api-key", "a", "--tenant-quota", "a=lots"], "in (0, 1]"),
    (["--api-key", "a", "--tenant-quota", "a=nan"], "in (0, 1]"),
    (["--api-key", "a", "--tenant-quota", "a0.5"], "expected KEY=FRACTION"),
    (["--api-key", "a", "--api-key", "b", "--tenant-quota", "a=0.6", "--tenant-quota",
      "b=0.6"], "sum to 1.2 > 1"),
    (["--api-key", "a", "--tenant-quota", "a=0.3", "--tenant-quota", "tenant0=0.2"],
     "already has a quota"),
    (["--api-key", "a", "--api-key", "b", "--tenant-quota", "a=1"],
     "no burst pool for tenant1"),
    (["--api-key", "a", "--api-key", "a"], "repeats an earlier key"),
    (["--api-key", ""], "empty"),
])
def test_tenant_quota_errors(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    # checked before the model is looked at or loaded
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "/nonexistent/model", *argv])
    assert exc.value.code == 2  # server/cli.py: every start-up error exits 2
    text = capsys.readouterr().err
    assert text.startswith("kvserve: error: ") and message in text, text
    assert "secret-typo" not in text
