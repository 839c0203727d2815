"""The KV pool's size when nobody gives one (attention/sizing.py, native/memory.py): the
rule's arithmetic, the memory readers on this machine and on cgroup files laid out in a
temporary directory, engines sized by it (a smaller KVSERVE_MEMORY_LIMIT, a smaller
pool; the cap keeping a tiny model's pool tiny; the options still winning), the CLI's
start-up error when the memory holds no request, and what /metrics says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from attention.sizing import (
    CPU_FRACTION,
    KVPoolTooSmall,
    activation_reserve,
    auto_pool_blocks,
    blocks_for,
    moe_token_bytes,
)
from loadtest.spawn import free_port, python_path
from native.memory import (
    ENV_LIMIT,
    available_bytes,
    cgroup_headroom,
    meminfo_available,
    parse_bytes,
    resident_bytes,
)
from scheduler.engine_core import EngineConfig, EngineCore
from tests.live_server import tiny_server
from tests.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
GiB, MiB = 2**30, 2**20
BLOCK = 4096  # the tiny llama's block: 2 (K, V) × 16 tokens × 2 kv heads × 16 dims × 4 B


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


# ---- the rule ------------------------------------------------------------------------
def test_the_host_rule_takes_a_fraction_less_the_reserve() -> None:
    a = auto_pool_blocks(10 * GiB, MiB, 10**9, 0, 0.5)
    assert (a.num_blocks, a.budget, a.capped) == (5 * 1024, 5 * GiB, False)
    b = auto_pool_blocks(10 * GiB, MiB, 10**9, 512 * MiB, 0.5)
    assert b.num_blocks == 5 * 1024 - 512 and b.budget == 5 * GiB - 512 * MiB
    assert auto_pool_blocks(10 * GiB, MiB, 10**9, 0, 0.25).num_blocks == 2560
    # a block's bytes round down: never more than the budget
    assert auto_pool_blocks(10 * GiB + 3, 3 * MiB, 10**9, 0, 0.5).num_blocks == 5 * 1024 // 3


def test_the_device_rule_is_vllms_utilization_of_the_total() -> None:
    """0.9 of an 80 GiB GPU is 72 GiB; 20 GiB are in use (60 free), so 52 GiB remain,
    less a 2 GiB reserve."""
    a = auto_pool_blocks(60 * GiB, GiB, 10**6, 2 * GiB, 0.9, total=80 * GiB)
    assert a.num_blocks == 50 and not a.capped


def test_the_cap_is_what_the_engine_can_fill() -> None:
    cap = blocks_for(256, 1024, 16, 4)  # the demo model's defaults
    assert cap == 256 * 64 * 4
    a = auto_pool_blocks(100 * GiB, 8192, cap, 0, 0.5)
    assert a.num_blocks == cap and a.capped and a.budget == 50 * GiB
    assert blocks_for(1, 17, 16, 3) == 2 * 3  # a partial block counts


def test_too_little_for_one_request_is_an_error_naming_the_option() -> None:
    one = blocks_for(1, 2048, 16, 12)
    with pytest.raises(KVPoolTooSmall) as e:
        auto_pool_blocks(100 * MiB, 98304, 10**9, 40 * MiB, 0.5, min_blocks=one,
                         context=2048)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "--kv-cache-memory" in msg and "2,048 tokens" in msg and "100 MiB" in msg
    # the reserve alone can eat the budget: no negative pool
    with pytest.raises(KVPoolTooSmall):
        auto_pool_blocks(GiB, MiB, 10**9, 2 * GiB, 0.5)
    # exactly one request is enough
    assert auto_pool_blocks(2 * one * 98304, 98304, 10**9, 0, 0.5,
                            min_blocks=one).num_blocks == one


def test_activation_reserve() -> None:
    """The 160M shape: its widest row is the MLP's gate and up (2 × 3,072), fp32, for
    2,048 tokens four times, plus 256 rows of 32,000 fp32 logits and probabilities."""
    r = activation_reserve(2048, 2 * 3072, 4, 256, 32000)
    assert r == 4 * 2048 * 6144 * 4 + 2 * 256 * 32000 * 4
    assert 250 * MiB < r < 260 * MiB


# A step of this many prompt tokens, one sequence (so the logits' part of the reserve is
# one row's), on the tiny mixture-of-experts models: whole-step peak and sparse blocks'.
MOE_TOKENS = 512


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_the_activation_reserve_covers_a_moe_step(tmp_path: Path, family: str) -> None:
    """Measured (tests/allocations.py): the sparse blocks of a real prefill step of 512
    tokens hold at most `moe_token_bytes` a token, and at least their gate and up rows
    and sorted input (k rows a token); the whole step's allocations stay within the
    reserve, where the dense rule alone (4 of the widest rows: Mixtral's is its one
    expert's gate and up) fell short of Mixtral's. gpt-oss's whole step is left out: its
    prompt attention with sinks takes the explicit softmax where the AVX-512 prefill op
    does not run, [heads, rows, keys] of scores that no reserve counts."""
    from engine.models.moe import SparseMoe
    from engine.sampling import SamplingParams
    from scheduler.llm import LLM
    from scheduler.pool_shape import step_activations
    from tests.allocations import PeakAllocations

    t = MOE_TOKENS
    model = make_tiny_model(family, tmp_path / family, max_position_embeddings=2 * t)
    eng = LLM(model, num_blocks=256, device="cpu", max_num_batched_tokens=t,
              max_num_seqs=1).engine
    mc, spec = eng.model_config, None
    m = PeakAllocations()
    blocks: list[int] = []
    for module in eng.model.modules():
        if isinstance(module, SparseMoe):
            spec = module.spec
            module.register_forward_pre_hook(lambda *_: m.mark())
            module.register_forward_hook(lambda *_: blocks.append(m.peak_since()))
    eng.add_request("r", [5 + i % 250 for i in range(t)], SamplingParams(
        max_tokens=2, temperature=0, ignore_eos=True, detokenize=False))
    with m:
        eng.step()  # the prompt, whole
    overall = m.peak
    assert spec is not None and blocks
    h, i, k = spec.hidden_size, spec.intermediate_size, spec.top_k
    assert t * k * (h + 2 * i) * 4 <= max(blocks) <= t * moe_token_bytes(h, i, k, 4)
    reserve = step_activations(eng.config, mc, 4)
    if family == "gpt_oss":
        return
    assert max(blocks) <= overall <= reserve
    widest = max(h, (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim,
                 2 * mc.hf_config.intermediate_size)
    if family == "mixtral":
        assert activation_reserve(t, widest, 4, 1, mc.vocab_size) < overall


# ---- the memory readers --------------------------------------------------------------
def test_available_memory_on_this_machine() -> None:
    total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024  # MemTotal
    meminfo = meminfo_available()
    assert meminfo is not None and 64 * MiB < meminfo <= total
    got = available_bytes(environ={})
    assert 0 < got.bytes <= meminfo and got.source in ("MemAvailable", "cgroup_v2",
                                                       "cgroup_v1")
    assert got.seen["MemAvailable"] > 0
    assert 32 * MiB < resident_bytes() < total  # this Python with torch loaded
    # KVSERVE_MEMORY_LIMIT is read like a container's limit: minus what we hold
    limited = available_bytes(environ={ENV_LIMIT: "1GiB"})
    assert limited.source == ENV_LIMIT and limited.bytes <= GiB - 32 * MiB
    assert available_bytes(environ={ENV_LIMIT: "1MiB"}).bytes == 0  # never negative
    with pytest.raises(ValueError, match=ENV_LIMIT):
        available_bytes(environ={ENV_LIMIT: "lots"})


def _lay_out(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


MEMINFO = "MemTotal:       33554432 kB\nMemFree:  1000 kB\nMemAvailable:   16777216 kB\n"


def test_cgroup_v2_limit_minus_working_set(tmp_path: Path) -> None:
    """A Kubernetes container: its own limit 6 GiB, its pod's 4 GiB (the tighter one),
    usage counted less the inactive file cache (the weights' page cache)."""
    cg = "sys/fs/cgroup/kubepods/pod1"
    root = _lay_out(tmp_path, {
        "proc/meminfo": MEMINFO,
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        f"{cg}/memory.max": str(4 * GiB),
        f"{cg}/memory.current": str(3 * GiB),
        f"{cg}/memory.stat": f"anon 100\nfile 200\ninactive_file {GiB}\nactive_file 5\n",
        f"{cg}/ctr/memory.max": str(6 * GiB),
        f"{cg}/ctr/memory.current": str(2 * GiB),
        "sys/fs/cgroup/memory.max": "max\n",  # the root: no limit
        "sys/fs/cgroup/memory.current": str(20 * GiB),
    })
    assert meminfo_available(root) == 16 * GiB
    assert cgroup_headroom(root) == (4 * GiB - (3 * GiB - GiB), "cgroup_v2")
    got = available_bytes(root, environ={})
    assert (got.bytes, got.source) == (2 * GiB, "cgroup_v2")
    assert got.seen == {"MemAvailable": 16 * GiB, "cgroup_v2": 2 * GiB}


def test_cgroup_v2_seen_from_inside_a_namespace(tmp_path: Path) -> None:
    """A container with its own cgroup namespace sees itself at the root ("0::/")."""
    root = _lay_out(tmp_path, {
        "proc/meminfo": MEMINFO,
        "proc/self/cgroup": "0::/\n",
        "sys/fs/cgroup/memory.max": str(8 * GiB),
        "sys/fs/cgroup/memory.current": str(5 * GiB),
    })
    assert available_bytes(root, environ={}).bytes == 3 * GiB


def test_cgroup_v1_and_no_limit(tmp_path: Path) -> None:
    """A hybrid host (v2 mounted without the memory controller, v1's memory hierarchy):
    the v1 limit counts; v1's "no limit" (2^63 rounded to a page) and v2's "max" do not."""
    v1 = "sys/fs/cgroup/memory"
    files = {
        "proc/meminfo": MEMINFO,
        "proc/self/cgroup": "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        f"{v1}/memory.limit_in_bytes": "9223372036854771712\n",
        f"{v1}/docker/abc/memory.limit_in_bytes": str(3 * GiB),
        f"{v1}/docker/abc/memory.usage_in_bytes": str(2 * GiB),
        f"{v1}/docker/abc/memory.stat": f"cache 5\ninactive_file 7\ntotal_inactive_file "
                                        f"{512 * MiB}\n",
    }
    root = _lay_out(tmp_path / "limited", files)
    got = available_bytes(root, environ={})
    assert (got.bytes, got.source) == (GiB + 512 * MiB, "cgroup_v1")
    files[f"{v1}/docker/abc/memory.limit_in_bytes"] = "9223372036854771712\n"
    unlimited = _lay_out(tmp_path / "unlimited", files)
    assert cgroup_headroom(unlimited) is None
    assert available_bytes(unlimited, environ={}).source == "MemAvailable"
    # KVSERVE_MEMORY_LIMIT minus this process's resident memory, when it is the smallest
    (unlimited / "proc/self/status").write_text("Name: python\nVmRSS:   1048576 kB\n")
    got = available_bytes(unlimited, environ={ENV_LIMIT: "3GiB"})
    assert (got.bytes, got.source) == (2 * GiB, ENV_LIMIT)


def test_parse_bytes_reads_binary_and_decimal_units() -> None:
    assert parse_bytes("1.5GiB") == 3 * GiB // 2 and parse_bytes("2MB") == 2_000_000
    with pytest.raises(ValueError):
        parse_bytes("lots")


# ---- engines -------------------------------------------------------------------------
def test_the_cap_keeps_a_tiny_models_pool_tiny(model_dir: str) -> None:
    """256 sequences of the tiny llama's 256 positions: 48 MiB, whatever the machine
    has (the default 512 MiB pool was ten times that, zeroed by every test engine)."""
    core = EngineCore(EngineConfig(model=model_dir))
    s = core.kv_sizing
    assert s.source == "auto" and s.available_source in ("MemAvailable", "cgroup_v2",
                                                         "cgroup_v1")
    if s.available * CPU_FRACTION < 64 * MiB:
        pytest.skip("this machine has too little memory free for the cap to decide")
    assert s.num_blocks == core.pool.num_blocks == blocks_for(256, 256, 16, 3) == 12288
    assert s.bytes == 12288 * BLOCK == 48 * MiB and s.tokens == 256 * 256
    assert "capped at 256 sequences × 256 tokens" in s.describe()
    assert s.describe().startswith("KV pool: 48 MiB (auto: 50% of ")


def test_a_smaller_memory_limit_gives_a_smaller_pool(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """KVSERVE_MEMORY_LIMIT, set as a container's limit would be: 64 MiB more than this
    process holds now leaves the engine about that after its weights, half of it for
    the pool; without it, the pool is the cap (32 sequences of 4,096 tokens: 96 MiB).
    "About": what the process holds can shrink between the reading here and the
    engine's own (the allocator hands freed pages back), which leaves it a few MiB more."""
    model = make_tiny_model("llama", tmp_path / "long", max_position_embeddings=4096)
    config = EngineConfig(model=model, max_num_seqs=32)
    monkeypatch.setenv(ENV_LIMIT, str(resident_bytes() + 64 * MiB))
    small = EngineCore(config).kv_sizing  # first: the other's pool would not count
    monkeypatch.delenv(ENV_LIMIT)
    big = EngineCore(config).kv_sizing
    assert small.available_source == ENV_LIMIT and small.available <= 80 * MiB
    assert big.available_source != ENV_LIMIT
    if big.available * CPU_FRACTION < 128 * MiB:
        pytest.skip("this machine has too little memory free for the comparison")
    assert big.num_blocks == blocks_for(32, 4096, 16, 3)
    assert blocks_for(1, 4096, 16, 3) <= small.num_blocks < big.num_blocks
    assert small.bytes <= small.available * CPU_FRACTION < big.bytes


def test_the_options_still_win(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a limit that holds nothing, --num-blocks and --kv-cache-memory still size
    the pool; without them the engine refuses to start."""
    monkeypatch.setenv(ENV_LIMIT, "1MiB")
    by_blocks = EngineCore(EngineConfig(model=model_dir, num_blocks=64))
    assert by_blocks.pool.num_blocks == 64 and by_blocks.kv_sizing.source == "num_blocks"
    by_bytes = EngineCore(EngineConfig(model=model_dir, kv_cache_memory="1MiB",
                                       num_blocks=None))
    assert by_bytes.pool.num_blocks == MiB // BLOCK
    assert by_bytes.kv_sizing.source == "kv_cache_memory"
    assert by_bytes.kv_sizing.available == 0 and "--kv-cache-memory 1MiB" in \
        by_bytes.kv_sizing.describe()
    with pytest.raises(KVPoolTooSmall, match="--kv-cache-memory"):
        EngineCore(EngineConfig(model=model_dir))


# ---- the CLI and the server ----------------------------------------------------------
def test_serve_with_too_little_memory_exits_2_naming_the_option(model_dir: str) -> None:
    """`kvserve serve` (the engine in its own process, as by default) loads the weights,
    finds the memory left holds no request, and exits 2 with one `kvserve: error:` line
    that names --kv-cache-memory and the limit it saw."""
    p = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", model_dir,
         "--port", str(free_port()), "--log-format", "text"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": python_path(), ENV_LIMIT: "1MiB"})
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("kvserve: error:")]
    assert len(errors) == 1, p.stderr
    assert "too little memory for the KV pool" in errors[0]
    assert "--kv-cache-memory" in errors[0] and ENV_LIMIT in errors[0]
    assert "Traceback" not in p.stderr


def test_generate_with_too_little_memory_exits_2(model_dir: str,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    from server.cli import main

    monkeypatch.setenv(ENV_LIMIT, "1MiB")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", model_dir, "--prompt", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error: too little memory") and "--kv-cache-memory" in err
    monkeypatch.setenv(ENV_LIMIT, "lots")  # checked before any model loads
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "/nonexistent/model", "--prompt", "x"])
    assert exc.value.code == 2 and ENV_LIMIT in capsys.readouterr().err


def test_metrics_report_the_pool_and_how_it_was_sized(model_dir: str) -> None:
    with tiny_server(model_dir, num_blocks=None) as server, \
            httpx.Client(base_url=server.url, timeout=60) as c:
        text = c.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    blocks = samples["kvserve_kv_blocks_capacity", ()]
    assert blocks > 0 and samples["kvserve_kv_cache_bytes", ()] == blocks * BLOCK
    [(labels, value)] = [(dict(k[1]), v) for k, v in samples.items()
                         if k[0] == "kvserve_kv_cache_sizing_info"]
    assert value == 1 and labels["source"] == "auto"
    assert labels["available_source"] in ("MemAvailable", "cgroup_v2", "cgroup_v1",
                                          ENV_LIMIT)
    assert samples["kvserve_kv_cache_available_bytes", ()] > 0
