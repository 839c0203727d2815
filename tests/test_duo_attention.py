"""DuoAttention (`duo`, policies/duo_attention.py) over a per-head pool, the head roles
it streams by (scheduler/head_roles.py, `kvserve head-roles`), the spread across heads a
per-head server reports, and the prefix-hit limit of bounded policies (issue 65)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from engine.demo import DEMO_MODEL_DIR
from engine.sampling import SamplingParams
from policies.config import KVPolicyError
from policies.duo_attention import DuoConfig, streaming_lanes
from scheduler.head_roles import ROLES_FILE, load_roles, passkey_prompts
from scheduler.llm import LLM
from scheduler.resolve import resolve_request
from server.cli import main
from server.testing import ServerThread
from tests.live_server import tiny_server

MODEL = str(DEMO_MODEL_DIR)
RETRIEVAL_LANE = 4  # layer 2, kv head 0: the demo model's one retrieval head (its roles)


def test_streaming_lanes_are_the_lowest_scored_or_the_named() -> None:
    roles = torch.tensor([0.3, 0.0, 1.0, 0.0, 0.5, 0.2])
    half = streaming_lanes(DuoConfig(streaming_ratio=0.5), roles, 6)
    assert half == [False, True, False, True, False, True]  # 0.0, 0.0 (lower lane first), 0.2
    assert streaming_lanes(DuoConfig(streaming_ratio=0.0), roles, 6) == [False] * 6
    assert streaming_lanes(DuoConfig(streaming_heads=[2, 5]), None, 6) == [
        False, False, True, False, False, True]


def test_the_demo_models_roles_name_its_retrieval_head() -> None:
    """The shipped roles file (made by `kvserve head-roles` on the demo model): one head
    carries the pass key, every other scores near 0."""
    roles = load_roles(MODEL, 4, 2)
    assert roles is not None and roles.shape == (8,)
    assert int(roles.argmax()) == RETRIEVAL_LANE and float(roles.max()) == 1.0
    assert float(roles[torch.arange(8) != RETRIEVAL_LANE].max()) < 0.01


def test_roles_of_another_shape_are_refused(tmp_path: Path) -> None:
    (tmp_path / ROLES_FILE).write_text(json.dumps({"scores": [[1.0, 0.0]]}))
    with pytest.raises(ValueError, match="kvserve head-roles"):
        load_roles(tmp_path, 4, 2)
    assert load_roles(tmp_path / "none", 4, 2) is None


@pytest.fixture(scope="module")
def head_llm() -> LLM:
    return LLM(MODEL, kv_cache_memory="64MiB", device="cpu", kv_layout="head",
               max_num_batched_tokens=64)


def _passkeys(llm: LLM, n: int, length: int) -> tuple[list[list[int]], list[str]]:
    bos = llm.tokenizer.bos_token_id

    def encode(text: str) -> list[int]:
        return [t for t in llm.tokenizer.encode(text) if t != bos]

    cases = passkey_prompts(encode, n, length, seed=3)
    return ([[bos, *ids[:-k]] for ids, k in cases],
            [llm.tokenizer.decode(ids[-k:]) for ids, k in cases])


def _found(text: str, answer: str) -> bool:
    m = re.search(r"\d+", text)
    return m is not None and m.group() in answer


def test_duo_keeps_the_pass_key_with_seven_of_eight_heads_streaming(head_llm: LLM) -> None:
    """By the roles, 7 of the demo model's 8 (layer, kv head) pairs stream (sinks + a
    64-token window) and the pass key is still found at every depth; streaming the one
    retrieval head instead, or every head (StreamingLLM), loses it. The streaming heads
    hold sink + window, the retrieval head the whole prompt."""
    prompts, answers = _passkeys(head_llm, 4, 480)
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    duo = head_llm.generate(prompts, sp, kv_policy={
        "name": "duo", "streaming_ratio": 0.875, "sink": 4, "window": 64})
    assert all(_found(o.text, a) for o, a in zip(duo, answers)), [o.text for o in duo]
    for o in duo:
        # (at the end the last step's token is in before the policy's turn)
        assert o.kv is not None and 4 + 64 <= o.kv.head_live_min <= 4 + 64 + 1
        assert o.kv.head_live_max == len(prompts[0]) + 7  # every token but the last sampled
    wrong = head_llm.generate(prompts, sp, kv_policy={
        "name": "duo", "streaming_heads": [RETRIEVAL_LANE], "sink": 4, "window": 64})
    assert sum(_found(o.text, a) for o, a in zip(wrong, answers)) <= 1
    head_llm.engine.check_invariants()


def test_duo_needs_a_head_pool_roles_and_lanes_of_the_model(tmp_path: Path,
                                                             head_llm: LLM) -> None:
    """400s naming the field: duo on a per-layer pool, a ratio on a model without roles,
    a lane past the model's, heads other than uniform."""
    layer = LLM(MODEL, num_blocks=64, device="cpu")
    with pytest.raises(KVPolicyError) as e:
        resolve_request(layer.engine.limits, "duo")
    assert e.value.param == "kv_policy" and "--kv-layout head" in str(e.value)
    bare = tmp_path / "model"  # the demo model without its roles file
    shutil.copytree(MODEL, bare, ignore=shutil.ignore_patterns(ROLES_FILE))
    no_roles = LLM(str(bare), num_blocks=128, device="cpu", kv_layout="head")
    with pytest.raises(KVPolicyError) as e:
        resolve_request(no_roles.engine.limits, {"name": "duo", "streaming_ratio": 0.5})
    assert e.value.param == "kv_policy.streaming_ratio" and "kvserve head-roles" in str(e.value)
    resolve_request(no_roles.engine.limits, {"name": "duo", "streaming_heads": [1, 3]})
    with pytest.raises(KVPolicyError) as e:
        resolve_request(head_llm.engine.limits, {"name": "duo", "streaming_heads": [8]})
    assert e.value.param == "kv_policy.streaming_heads"
    with pytest.raises(KVPolicyError) as e:
        resolve_request(head_llm.engine.limits, {"name": "duo", "heads": "shared"})
    assert e.value.param == "kv_policy.heads"


def test_head_roles_command_writes_the_roles_beside_the_model(tmp_path: Path) -> None:
    """`kvserve head-roles` on a copy of the demo model (short prompts): the file loads,
    the retrieval head scores 1."""
    model = tmp_path / "model"
    shutil.copytree(MODEL, model, ignore=shutil.ignore_patterns(ROLES_FILE))
    assert main(["head-roles", "--model", str(model), "--device", "cpu", "--prompts", "2",
                 "--length", "256", "--window", "32"]) == 0
    data = json.loads((model / ROLES_FILE).read_text())
    assert (data["num_layers"], data["num_kv_heads"], data["prompts"]) == (4, 2, 2)
    roles = load_roles(model, 4, 2)
    assert roles is not None and int(roles.argmax()) == RETRIEVAL_LANE


@pytest.mark.parametrize("layout", ["layer", "head"])
def test_a_prefix_hit_never_holds_more_than_the_bound_and_a_chunk(layout: str) -> None:
    """A bounded request whose whole prompt is in the prefix cache takes only the hit
    blocks within its bound: it never holds more than the bound plus one chunk (it used
    to take the whole cached prompt, then evict it)."""
    llm = LLM(MODEL, kv_cache_memory="64MiB", device="cpu", kv_layout=layout,
              max_num_batched_tokens=64)
    prompt = [5 + (7 * i) % 300 for i in range(600)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], sp, kv_policy="full")  # caches the prompt
    out = llm.generate([prompt], sp, kv_policy={"name": "streaming", "sink": 4, "window": 60})
    kv = out[0].kv
    assert kv is not None and kv.prefix_hit_tokens > 0
    assert kv.peak_live_tokens <= 4 + 60 + 64, kv
    llm.engine.check_invariants()


@pytest.fixture(scope="module")
def head_server() -> Iterator[ServerThread]:
    with tiny_server(MODEL, num_blocks=1024, device="cpu", kv_layout="head") as s:
        yield s


def test_a_head_server_reports_the_spread_across_heads(head_server: ServerThread) -> None:
    """usage.kv_cache carries the fewest and most live tokens of a (layer, kv head), and
    /metrics a request's imbalance; a duo request with a bad lane is a 400 in OpenAI's
    shape and the server goes on serving."""
    prompt = "The grass is green. The sky is blue. " * 12
    with httpx.Client(base_url=head_server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
            "kv_policy": {"name": "duo", "streaming_heads": [0, 1, 2], "window": 16}})
        assert r.status_code == 200, r.text
        kv = r.json()["usage"]["kv_cache"]
        assert 4 + 16 <= kv["head_live_tokens_min"] <= 4 + 16 + 1, kv
        assert kv["head_live_tokens_max"] > 60, kv
        r = c.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 2,
            "kv_policy": {"name": "duo", "streaming_heads": [99]}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == "kv_policy.streaming_heads"
        metrics = c.get("/metrics").text
        count = re.search(r"^kvserve_request_kv_head_imbalance_count (\S+)$", metrics, re.M)
        assert count is not None and float(count.group(1)) >= 1, metrics[:500]
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "once", "max_tokens": 2})
        assert r.status_code == 200
