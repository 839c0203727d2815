"""Bad input around per-head KV pages (`--kv-layout head`) and kv_policy's `heads`: a
layer pool refuses per-head modes, a policy with no scores refuses adaptive, an unknown
mode is refused (a KVPolicyError naming kv_policy.heads; a 400 in OpenAI's shape over
HTTP, the server serving on), and the command line refuses a bad layout or a per-head
default policy on a layer pool before loading. The layouts themselves:
tests/test_kv_layout.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.demo import DEMO_MODEL_DIR
from policies.config import KVPolicyError
from scheduler.llm import LLM
from scheduler.resolve import resolve_request
from server.cli import main
from server.testing import ServerThread
from tests.live_server import tiny_server

MODEL = str(DEMO_MODEL_DIR)
BS = 4


@pytest.fixture(scope="module")
def head_llm() -> LLM:
    return LLM(MODEL, num_blocks=800, block_size=BS, device="cpu", kv_layout="head")


# ---- 6. bad input ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layer_llm() -> LLM:
    return LLM(MODEL, num_blocks=64, block_size=BS, device="cpu")


@pytest.mark.parametrize(("policy", "message"), [
    ({"name": "knorm", "heads": "uniform"}, "--kv-layout head"),
    ({"name": "knorm", "heads": "adaptive"}, "--kv-layout head"),
    ({"name": "streaming", "heads": "adaptive"}, "ranks no tokens by score"),
    ({"name": "knorm", "heads": "bogus"}, "'uniform', 'adaptive' or 'shared'"),
])
def test_bad_heads_are_a_policy_error_naming_heads(layer_llm: LLM, policy: dict,
                                                   message: str) -> None:
    """A layer pool refuses per-head modes, a policy with no score refuses adaptive, and an
    unknown mode is refused: each a KVPolicyError naming kv_policy.heads."""
    with pytest.raises(KVPolicyError, match=message) as exc:
        resolve_request(layer_llm.engine.limits, policy)
    assert exc.value.param == "kv_policy.heads"
    # shared is what a layer pool keeps: accepted
    resolve_request(layer_llm.engine.limits, {**policy, "heads": "shared"})


def test_head_pool_accepts_per_head_modes_but_not_unscored_adaptive(head_llm: LLM) -> None:
    """A head pool takes uniform and adaptive for a scoring policy, still not adaptive for
    streaming."""
    limits = head_llm.engine.limits
    for heads in ("uniform", "adaptive", "shared"):
        resolved = resolve_request(limits, {"name": "knorm", "heads": heads})
        assert resolved.kv_policy.heads == heads  # type: ignore[attr-defined]
    with pytest.raises(KVPolicyError) as exc:
        resolve_request(limits, {"name": "streaming", "heads": "adaptive"})
    assert exc.value.param == "kv_policy.heads"


def test_a_per_head_default_policy_on_a_layer_pool_is_refused() -> None:
    """An engine whose default kv_policy keeps tokens per head needs a head pool."""
    with pytest.raises(KVPolicyError) as exc:
        LLM(MODEL, num_blocks=64, block_size=BS, device="cpu",
            default_kv_policy={"name": "knorm", "heads": "uniform"})
    assert exc.value.param == "kv_policy.heads"


@pytest.fixture(scope="module")
def layer_server() -> Iterator[ServerThread]:
    with tiny_server(MODEL, num_blocks=256, device="cpu") as s:
        yield s


def test_http_per_head_mode_on_a_layer_server_is_a_400(layer_server: ServerThread) -> None:
    """Over HTTP a layer-layout server answers uniform (and an unscored adaptive) with a 400
    in OpenAI's error shape naming kv_policy.heads, then serves a normal request."""
    with httpx.Client(base_url=layer_server.url, timeout=60) as c:
        for policy in ({"name": "knorm", "budget": 8, "heads": "uniform"},
                       {"name": "streaming", "heads": "adaptive"}):
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "once upon a time",
                                                "max_tokens": 4, "kv_policy": policy})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            assert err["param"] == "kv_policy.heads", err
        r = c.post("/v1/completions", json={
            "model": "tiny", "prompt": "once upon a time", "max_tokens": 4, "ignore_eos": True,
            "kv_policy": {"name": "knorm", "budget": 8, "heads": "shared"}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4


# ---- 7. the command line -----------------------------------------------------------------


def test_bad_kv_layout_exits_2(capsys: pytest.CaptureFixture) -> None:
    """`kvserve serve --kv-layout bogus` is an argparse error (exit 2) naming the option."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "/nonexistent/model", "--kv-layout", "bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-layout" in err and "invalid choice" in err, err


def test_per_head_default_policy_on_a_layer_server_exits_2_before_loading(
        capsys: pytest.CaptureFixture) -> None:
    """`--default-kv-policy` with heads uniform and no `--kv-layout head` is refused as
    every bad default policy is: one error line, exit 2, before the model is looked at."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "/nonexistent/model",
              "--default-kv-policy", '{"name": "knorm", "heads": "uniform"}'])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvserve: error: --default-kv-policy"), lines
