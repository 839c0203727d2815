"""Quantized KV pools (`--kv-cache-dtype int8 | fp8_e4m3 | int4`, attention/quant.py).

Error bounds of the codes, bytes counted with their scales, the three attention paths
(torch, the C++ decode kernel, Triton through the interpreter) agreeing on the same
quantized pool, the mechanisms that move blocks (copy-on-write, compaction, swap, RoPE
re-rotation) carrying the scales, and the engine's log-probabilities staying within a
per-format tolerance of transformers' fp32 forward on a tiny model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from attention.cpu_attention import kernel_available, paged_attention_cpu
from attention.quant import FORMATS, dequantize, quantize
from attention.storage import KVStorage
from attention.torch_attention import paged_attention
from engine.sampling import SamplingParams
from kvpool.pool import BlockPool
from kvpool.seq_cache import SeqCache
from scheduler.llm import LLM
from tests.pools import make_pool
from tests.tiny_models import make_tiny_model

QUANT = ["int8", "fp8_e4m3", "int4"]
# Teacher-forced |engine logprob - transformers fp32 logprob| per generated token on the
# tiny llama (random weights, so flat and sensitive logits). Measured worst cases: bf16
# 0.007, int8 0.019, fp8 0.059, int4 0.25; the bounds leave ~2x.
LOGPROB_TOL = {"int8": 0.05, "fp8_e4m3": 0.15, "int4": 0.5}
BS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"), max_position_embeddings=4096)


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    """Values spread over several magnitudes per head, like keys with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 8


@pytest.mark.parametrize("name", QUANT)
def test_quantize_dequantize_error_bounds(name: str) -> None:
    """int8/int4: at most half a step (the stored scale) per value; fp8 e4m3: 3 mantissa
    bits, so half an ulp, 2^-4 of the value (2^-10 of the scale among subnormals)."""
    fmt = FORMATS[name]
    x = _x(64, 2, 64)
    codes, sc = quantize(x, fmt)
    assert codes.dtype == fmt.storage and sc.dtype == torch.float16
    assert codes.shape[-1] == fmt.packed_dim(64) and sc.shape[-1] == fmt.num_groups(64)
    y = dequantize(codes, sc, fmt)
    err = (y - x).abs()
    s = sc.float().repeat_interleave(fmt.group_size(64), dim=-1)
    if name == "fp8_e4m3":
        bound = s * torch.maximum((x / s).abs() / 16, torch.full_like(x, 2.0**-10))
    else:
        bound = s / 2
    assert bool((err <= bound * 1.001 + 1e-7).all()), (err - bound).max()
    rel = (err.norm() / x.norm()).item()
    assert rel < {"int8": 0.01, "fp8_e4m3": 0.04, "int4": 0.15}[name], rel
    zeros = dequantize(*quantize(torch.zeros(3, 2, 64), fmt), fmt)  # scale 0: no NaN
    assert torch.equal(zeros, torch.zeros(3, 2, 64))


def test_bytes_per_block_count_the_scales(model) -> None:
    """Codes plus fp16 scales, per (token, kv head) or per 32-channel group for int4; a
    pool sized in bytes holds as many more blocks as the bytes allow."""
    bs, h, d = 16, 2, 64
    bf16 = KVStorage.bytes_per_block(bs, h, d, torch.bfloat16)
    assert KVStorage.bytes_per_block(bs, h, d, "int8") == 2 * bs * h * (d + 2)
    assert KVStorage.bytes_per_block(bs, h, d, "fp8_e4m3") == 2 * bs * h * (d + 2)
    assert KVStorage.bytes_per_block(bs, h, d, "int4") == 2 * bs * h * (d // 2 + 2 * 2)
    assert bf16 / KVStorage.bytes_per_block(bs, h, d, "int4") > 3.5
    pool = make_pool(10, bs, h, d, dtype="int4")
    assert pool.storage.nbytes == 10 * pool.storage.block_bytes == 10 * KVStorage.bytes_per_block(bs, h, d, "int4")
    wide = LLM(model, kv_cache_memory="1MiB", kv_cache_dtype="bfloat16").engine.storage
    for name in QUANT:
        narrow = LLM(model, kv_cache_memory="1MiB", kv_cache_dtype=name).engine.storage
        assert narrow.dtype_name == name and narrow.nbytes <= 1 << 20
        assert narrow.num_blocks == (1 << 20) // narrow.block_bytes
        assert narrow.num_blocks > 1.5 * wide.num_blocks


def test_int4_needs_an_even_head_dim() -> None:
    with pytest.raises(ValueError, match="int4"):
        make_pool(4, 4, 1, 15, dtype="int4")
    with pytest.raises(ValueError, match="quantized KV format"):
        make_pool(4, 4, 1, 16, dtype="int3")


def _filled(name: str, d: int = 32, hkv: int = 2, blocks: int = 40) -> tuple[BlockPool, torch.Tensor]:
    """A pool with every slot written; returns it and the values written [slots, H, D]."""
    pool = make_pool(blocks, BS, hkv, d, dtype=name)
    x = torch.stack([_x(blocks * BS, hkv, d, seed=1), _x(blocks * BS, hkv, d, seed=2)])
    pool.storage.write(torch.arange(blocks * BS), x[0], x[1])
    return pool, x


def _stored(pool: BlockPool, slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([pool.storage.read_slots(slots, 0), pool.storage.read_slots(slots, 1)])


@pytest.mark.parametrize("name", QUANT)
def test_statistics_read_the_dequantized_values(name: str) -> None:
    """What policies score (key norms, keys, value norms) is what attention sees."""
    pool, x = _filled(name)
    phys = torch.tensor([3, 17, 40, 41, 99])
    fmt = FORMATS[name]
    keys = dequantize(*quantize(x[0][phys], fmt), fmt)
    vals = dequantize(*quantize(x[1][phys], fmt), fmt)
    st = pool.storage.gather_stats(phys, key_norm=True, keys=True, value_norm=True)
    torch.testing.assert_close(st["keys"], keys)
    torch.testing.assert_close(st["key_norm"], keys.norm(dim=-1))
    torch.testing.assert_close(st["value_norm"], vals.norm(dim=-1))


def _case(pool: BlockPool, tq: int = 1, hq: int = 8) -> dict:
    """Three sequences over shuffled blocks: evicted slots, a short row, -1 pads."""
    g = torch.Generator().manual_seed(3)
    nb = 10
    table = torch.randperm(pool.num_blocks, generator=g)[: 3 * nb].view(3, nb)
    table[1, 7:] = -1
    sp = torch.arange(nb * BS).repeat(3, 1)
    sp[0, 5:9] = -1
    sp[1, 28:] = -1
    last = torch.tensor([39, 20, 30])
    q_pos = last[:, None] - torch.arange(tq - 1, -1, -1)
    q = torch.randn(3, tq, hq, pool.storage.head_dim, generator=g)
    return dict(q=q, table=table, slot_pos=sp, q_pos=q_pos, scale=pool.storage.head_dim ** -0.5)


def _reference(pool: BlockPool, case: dict, probs: bool):
    """The same attention over a float copy of the dequantized pool (test only)."""
    n = pool.num_blocks * BS
    kv = _stored(pool, torch.arange(n)).view(2, pool.num_blocks, BS, *pool.storage.kv.shape[3:4], -1)
    c = dict(case)
    return paged_attention(c.pop("q"), kv[0], kv[1], *c.values(), None, probs)


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("probs", [False, True])
@pytest.mark.parametrize("fn", [paged_attention, paged_attention_cpu], ids=["torch", "cpp"])
def test_torch_and_cpu_kernel_agree_on_quantized_pools(name: str, probs: bool, fn) -> None:
    if fn is paged_attention_cpu and not kernel_available():
        pytest.skip("no C++ compiler for the CPU kernel")
    pool, _ = _filled(name)
    case = _case(pool)
    ref, ref_mass = _reference(pool, case, probs)
    c = dict(case)
    q = c.pop("q")
    out, mass = pool.storage.attend(fn, q, *c.values(), None, probs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if probs:
        torch.testing.assert_close(mass, ref_mass, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize(("d", "hkv", "hq"), [(16, 1, 4), (64, 3, 6), (128, 2, 2), (24, 2, 4)])
@pytest.mark.parametrize("threads", [1, 4])
def test_cpu_kernel_on_quantized_pools_every_head_shape(name: str, d: int, hkv: int, hq: int,
                                                        threads: int) -> None:
    """int8 and fp8 take the AVX-512 path for head dims 16/32/64/128 (scales applied to
    scores and probabilities, GQA groups of 4, 2 or 1 heads), int4 and head dim 24 the
    portable one; 4 threads over 3 sequences cut them by kv heads. All equal attention
    over the dequantized pool, attention mass included."""
    if not kernel_available():
        pytest.skip("no C++ compiler for the CPU kernel")
    pool, _ = _filled(name, d=d, hkv=hkv)
    case = _case(pool, hq=hq)
    ref, ref_mass = _reference(pool, case, True)
    c = dict(case)
    q = c.pop("q")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out, mass = pool.storage.attend(paged_attention_cpu, q, *c.values(), None, True)
    finally:
        torch.set_num_threads(before)
    # Scaling the dot product instead of each code reorders fp32 roundings (values ~8).
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mass, ref_mass, atol=1e-5, rtol=1e-4)


def test_cpu_kernel_reads_every_fp8_code_exactly() -> None:
    """The vector path widens e4m3 codes through fp16 bit patterns: each of the 254 finite
    codes, normals and subnormals, must come out as torch's float8_e4m3fn value. Sequence
    j sees only slot j, so its output is V row j: codes 16j..16j+15 at scale 1."""
    if not kernel_available():
        pytest.skip("no C++ compiler for the CPU kernel")
    pool = make_pool(1, 16, 1, 16, dtype="fp8_e4m3")
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes == 0x7F], codes[codes == 0xFF] = 0, 0  # e4m3fn's NaNs never occur
    pool.storage.kv.view(torch.uint8)[1, 0, :, 0] = codes.view(16, 16)
    pool.storage.scales.fill_(1.0)
    slot_pos = torch.full((16, 16), -1, dtype=torch.long)
    slot_pos[torch.arange(16), torch.arange(16)] = 0
    q = torch.randn(16, 1, 1, 16)
    out, _ = pool.storage.attend(paged_attention_cpu, q, torch.zeros(16, 1, dtype=torch.long), slot_pos,
                         torch.zeros(16, 1, dtype=torch.long), 0.25, None, False)
    want = codes.view(torch.float8_e4m3fn).float().view(16, 16)
    torch.testing.assert_close(out[:, 0, 0], want, atol=0, rtol=0)


@pytest.mark.parametrize("name", QUANT)
def test_triton_agrees_on_quantized_pools(name: str) -> None:
    """Interpreted on CPU (TRITON_INTERPRET=1, fp32 maths): decode and a 3-query chunk,
    with the attention-mass pass."""
    pytest.importorskip("triton")
    from attention.triton_attention import paged_attention_triton
    from tests.attention_cases import DEV  # Triton compiles for CUDA where there is one

    pool, _ = _filled(name, d=16)
    on_dev = make_pool(pool.num_blocks, BS, pool.storage.kv.shape[3], 16, dtype=name, device=DEV)
    on_dev.storage.kv.copy_(pool.storage.kv)
    on_dev.storage.scales.copy_(pool.storage.scales)
    for tq in (1, 3):
        case = _case(pool, tq)
        ref, ref_mass = _reference(pool, case, True)
        c = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        q = c.pop("q")
        out, mass = on_dev.storage.attend(paged_attention_triton, q, *c.values(), None, True)
        torch.testing.assert_close(out.cpu(), ref.nan_to_num(0.0), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mass.cpu(), ref_mass.nan_to_num(0.0), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", QUANT)
def test_block_moves_carry_the_scales(name: str) -> None:
    """copy_blocks (copy-on-write), copy_slots (compaction) and read/write_blocks (swap)
    move codes and scales together: the dequantized values arrive unchanged."""
    pool, _ = _filled(name)
    slots_of = lambda b: torch.arange(b * BS, (b + 1) * BS)  # noqa: E731
    before = _stored(pool, slots_of(3))
    pool.storage.copy_blocks(torch.tensor([7]), torch.tensor([3]))
    assert torch.equal(_stored(pool, slots_of(7)), before)
    src, dst = torch.tensor([40, 45, 50]), torch.tensor([0, 1, 2])
    moved = _stored(pool, src)
    pool.storage.copy_slots(dst, src)
    assert torch.equal(_stored(pool, dst), moved)
    data = pool.storage.read_blocks(torch.tensor([5, 6]))
    assert len(data) == 2  # codes and scales
    ref = _stored(pool, torch.arange(5 * BS, 7 * BS))
    pool.storage.write_blocks(torch.tensor([9, 8]), data)
    assert torch.equal(_stored(pool, torch.cat([slots_of(9), slots_of(8)])), ref)


@pytest.mark.parametrize("name", QUANT)
def test_compaction_keeps_each_token_with_its_scale(name: str) -> None:
    pool = make_pool(32, BS, 2, 32, dtype=name)
    cache = SeqCache(pool, num_layers=2)
    slots = cache.append(torch.arange(30))  # [L, 30]
    x = _x(2, 30, 2, 32, seed=5)
    for layer in range(2):
        pool.storage.write(slots[layer], x[layer], -x[layer])
    want = {layer: _stored(pool, slots[layer]) for layer in range(2)}
    cache.evict(0, torch.tensor([1, 2, 5, 6, 9, 13, 14, 17]))
    cache.evict(1, torch.tensor([0, 4, 8, 12, 16]))
    assert cache.compact() > 0
    for layer in range(2):
        idx, phys = cache.live_slots(layer)
        pos = cache.slot_pos[layer, idx]
        assert torch.equal(_stored(pool, phys), want[layer][:, pos])


@pytest.mark.parametrize("name", QUANT)
def test_rerotation_dequantizes_rotates_and_requantizes(name: str) -> None:
    pool, _ = _filled(name)
    phys = torch.tensor([4, 5, 6, 30])
    delta = torch.tensor([-3, -3, -1, -7])
    old = pool.storage.read_slots(phys, 0)
    values = pool.storage.read_slots(phys, 1)

    def rotate(k: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # a stand-in rotation
        return torch.roll(k, 1, dims=-1) * (1 + 0.1 * d.float())[:, None, None]

    pool.storage.rerotate(phys, rotate, delta)
    fmt = FORMATS[name]
    want = dequantize(*quantize(rotate(old, delta), fmt), fmt)
    torch.testing.assert_close(pool.storage.read_slots(phys, 0), want)
    assert torch.equal(pool.storage.read_slots(phys, 1), values)  # V untouched


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(5, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _worst_logprob_error(model: str, prompts: list[list[int]], outs) -> float:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    worst = 0.0
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([p + o.token_ids])).logits[0].float(), -1)
        for j, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            worst = max(worst, abs(lp.logprob - logp[len(p) - 1 + j, tok].item()))
    return worst


@pytest.mark.parametrize("name", QUANT)
def test_greedy_logprobs_within_tolerance_of_transformers_fp32(model, name: str) -> None:
    """Prompts longer than the prefill chunk, so later chunks and every decode step read
    dequantized keys and values; then the same prompts again, now served from the
    prefix cache (quantized blocks with their scales), within the same tolerance."""
    llm = LLM(model, num_blocks=512, block_size=BS, max_num_batched_tokens=32,
              kv_cache_dtype=name)
    prompts = [_prompt(i, n) for i, n in enumerate((5, 40, 77, 130))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                            detokenize=False, logprobs=1)
    outs = llm.generate(prompts, params)
    assert _worst_logprob_error(model, prompts, outs) < LOGPROB_TOL[name]
    again = llm.generate(prompts[1:], params)
    assert all(o.kv.prefix_hit_tokens > 0 for o in again)
    assert _worst_logprob_error(model, prompts[1:], again) < LOGPROB_TOL[name]
    assert all(o.kv.peak_bytes == o.kv.peak_blocks * llm.engine.pool.storage.block_bytes for o in outs)
    llm.engine.check_invariants()
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize("name", QUANT)
def test_swapped_request_continues_as_one_never_swapped(model, name: str) -> None:
    """Swap moves codes and scales byte for byte: the same tokens as a pool where nobody
    is preempted. Prompts fit one prefill chunk in both runs, since a prompt's first
    chunk attends to its exact keys and later ones to stored (quantized) keys: different
    chunking alone would change tokens, whatever swap does."""
    prompts = [_prompt(10 + i, 8 + 2 * i) for i in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, detokenize=False)
    big = LLM(model, num_blocks=2000, block_size=BS, kv_cache_dtype=name)
    ref = [o.token_ids for o in big.generate(prompts, params)]
    small = LLM(model, num_blocks=130, block_size=BS, kv_cache_dtype=name,
                preemption_mode="swap", swap_space=1 << 20)
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.preemptions["swap"] > 0
    assert [o.token_ids for o in outs] == ref
    assert [t.dtype for t in small.engine.swap.tensors] == [small.engine.pool.storage.kv.dtype,
                                                            torch.float16]
    assert small.engine.pool.num_used == 0 and small.engine.swap.num_used == 0


def test_server_reports_the_dtype_and_bytes(model) -> None:
    """`/metrics` names the pool's format and block bytes; `usage.kv_cache` reports the
    request's peak bytes (blocks × bytes per block, scales included)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.live_server import tiny_server

    with tiny_server(model, kv_cache_dtype="int4", block_size=BS) as server, \
            httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        kv = r.json()["usage"]["kv_cache"]
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(c.get("/metrics").text)
                   for s in fam.samples}
    block = KVStorage.bytes_per_block(BS, 2, 16, "int4")  # the tiny llama: 2 kv heads of 16
    assert samples["kvserve_kv_block_bytes", ()] == block
    assert samples["kvserve_kv_cache_dtype_info", (("dtype", "int4"),)] == 1
    assert kv["peak_blocks"] > 0 and kv["peak_bytes"] == kv["peak_blocks"] * block


def test_cli_refuses_an_unknown_kv_cache_dtype_with_exit_2(capsys) -> None:
    """Checked by argparse before any model loads; the message lists the formats."""
    from server.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--kv-cache-dtype", "int3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "int4" in err and "fp8_e4m3" in err
