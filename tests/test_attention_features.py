"""The attention variants of newer model families in every CPU attention path, against the
model classes' maths (`tests.attention_cases.reference_attention`, float64):

- Gemma 2's logit soft-capping (`softcap`: cap * tanh(q·k · scale / cap), before the mask);
- gpt-oss's learned sinks (`sinks`: a logit per query head in each softmax's denominator,
  with no value), [Hq] or a row per sequence [B, Hq] (a per-head pool's rows); the mass a
  policy reads is then the real softmax's, the sink's share left out;
- both at once, under a sliding window or none.

Paths: the torch path (`paged_attention`: the fallback, and the explicit softmax the
variants take), the C++ decode kernel (`paged_attention_cpu`: the vector paths at head
dims 16-128 with 1, 2 or 4 query heads sharing a K load, the portable loop at others,
kv-head slices when there are fewer sequences than threads, the mass summed over heads),
its quantized decode (int8 and fp8 on the vector path, int4 on the portable one) and the
prompt's causal op, fresh and after a cached prefix (where it runs: AVX-512; SDPA's
explicit softmax elsewhere). The runner's per-layer contract (`layer_features`) closes
the file; Triton's kernels: tests/test_triton_features.py; the engine:
tests/test_attention_features_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from attention import cpu_attention
from attention.cpu_attention import (
    causal_prefill_cpu,
    paged_attention_cpu,
    prefix_prefill_cpu,
    prefix_prefill_runs,
)
from attention.storage import KVStorage
from attention.torch_attention import PAD_QUERY_POS, causal_self_attention, paged_attention
from engine.attention_groups import heads_features, layer_features
from engine.model_config import ModelConfig
from tests import attention_cases
from tests.attention_cases import reference_attention
from tests.tiny_models import make_tiny_config

needs_kernel = pytest.mark.skipif(not cpu_attention.kernel_available(),
                                  reason="no C++ compiler for the CPU kernel")
PATHS = [pytest.param(paged_attention, id="torch"),
         pytest.param(paged_attention_cpu, id="cpp", marks=needs_kernel)]
FEATURES = ["softcap", "sinks", "row_sinks", "both"]
CAP = 1.5  # scores of these cases are ~N(0, 1): a cap this low bends many of them


def make_case(*args, **kw) -> dict:
    return attention_cases.make_case(*args, device="cpu", **kw)


def features(name: str, case: dict, seed: int = 1) -> dict:
    """A feature's arguments for `case`: sinks drawn around the scores' own size, so that
    some rows' sink outweighs every slot and others' does not."""
    b, _, hq, _ = case["q"].shape
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    if name in ("softcap", "both"):
        out["softcap"] = CAP
    if name in ("sinks", "both"):
        out["sinks"] = torch.randn(hq, generator=g) * 2
    if name == "row_sinks":
        out["sinks"] = torch.randn(b, hq, generator=g) * 2
    return out


def check(fn, case: dict, feat: dict, window: int | None = None, probs: bool = False,
          atol: float = 1e-5, **kw) -> None:
    """fn's output (and mass) on the query rows that are not padding, against the reference."""
    out, mass = fn(**case, window=window, return_probs=probs, **feat, **kw)
    ref, ref_mass = reference_attention(case, window, **feat)
    real = case["q_pos"] < PAD_QUERY_POS
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    torch.testing.assert_close(out[real].double(), ref[real], atol=atol, rtol=atol)
    if probs:
        if kw.get("sum_heads"):
            ref_mass = ref_mass.sum(dim=2, keepdim=True)
        torch.testing.assert_close(mass[real].double(), ref_mass[real], atol=atol, rtol=atol)
    else:
        assert mass is None


# (hq, hkv, bs, d): the portable loop (d 8, 20), the vector paths with GQA groups of 4
# (d 32), 2 (d 64 at G 2) and 1 (MHA at d 64, d 128), blocks of 4 to 16.
SHAPES = [(4, 2, 4, 8), (8, 2, 16, 32), (4, 2, 8, 64), (4, 4, 16, 64), (2, 1, 8, 128),
          (6, 2, 16, 20)]


@pytest.mark.parametrize("fn", PATHS)
@pytest.mark.parametrize(("hq", "hkv", "bs", "d"), SHAPES)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("window", [None, 6])
def test_decode_rows(fn, hq: int, hkv: int, bs: int, d: int, feature: str,
                     window: int | None) -> None:
    """Ragged decode rows (one sees only itself; one is long enough for whole 16-slot
    tiles), evicted slots and -1 table columns."""
    case = make_case([0, 3, 17, 40, 129], [1] * 5, hq=hq, hkv=hkv, bs=bs, d=d,
                     evict={2: [1, 4, 5], 4: [0, 17, 18, 19, 100]}, extra_blocks=1)
    check(fn, case, features(feature, case), window)


@pytest.mark.parametrize(("fn", "sum_heads"), [
    pytest.param(paged_attention, False, id="torch"),
    pytest.param(paged_attention_cpu, False, id="cpp", marks=needs_kernel),
    pytest.param(paged_attention_cpu, True, id="cpp-summed", marks=needs_kernel)])
@pytest.mark.parametrize(("hq", "hkv", "bs", "d"), [(4, 2, 4, 8), (8, 2, 16, 32), (4, 4, 16, 64)])
@pytest.mark.parametrize("feature", FEATURES)
def test_decode_mass_is_the_real_softmax(fn, sum_heads: bool, hq: int, hkv: int, bs: int, d: int,
                                         feature: str) -> None:
    """The mass policies read: each slot's probability in the softmax the model runs (the
    sink in its denominator), summed over the query heads of its kv group, or over every
    head (`sum_heads`, the C++ kernel's; the torch path returns it per kv head)."""
    case = make_case([5, 30, 64], [1] * 3, hq=hq, hkv=hkv, bs=bs, d=d, evict={1: [2, 3]})
    feat = features(feature, case)
    check(fn, case, feat, probs=True, **({"sum_heads": True} if sum_heads else {}))
    if "sinks" in feat:  # the sink took a share: no row's mass sums to its heads' count
        _, mass = fn(**case, return_probs=True, **feat)
        assert (mass.sum(dim=-1) < hq // hkv - 1e-3).all()


@pytest.mark.parametrize("fn", PATHS)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 8), (8, 2, 32)])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_chunks_over_a_cached_prefix(fn, hq: int, hkv: int, d: int, feature: str,
                                             window: int | None) -> None:
    """Prompt chunks after cached prefixes, padded to the longest (padding rows are not
    compared), with the mass: the C++ wrapper hands them to the torch path."""
    case = make_case([0, 5, 20], [7, 16, 3], hq=hq, hkv=hkv, bs=4, d=d)
    check(fn, case, features(feature, case), window, probs=True)


@needs_kernel
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 32), (4, 4, 64), (4, 2, 8)])
@pytest.mark.parametrize("feature", FEATURES)
def test_fewer_sequences_than_threads_cut_by_kv_heads(hq: int, hkv: int, d: int,
                                                      feature: str) -> None:
    """One long sequence on 4 threads: the kernel cuts it into kv-head slices, each
    reading its own query heads' sinks (128K K/V elements read: a smaller call runs on
    one thread, native/csrc/team.h)."""
    case = make_case([(128 << 10) // (2 * hkv * d) + 20], [1], hq=hq, hkv=hkv, bs=16, d=d)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        check(paged_attention_cpu, case, features(feature, case), probs=True)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fn", PATHS)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 32), (4, 2, 64)])
@pytest.mark.parametrize("feature", FEATURES)
def test_quantized_pools(fn, name: str, hq: int, hkv: int, d: int, feature: str) -> None:
    """Decode over int8, fp8 and int4 pools (`KVStorage.attend` adds the format and
    scales): the reference reads the same dequantized values the pool holds."""
    case = make_case([3, 40, 70], [1] * 3, hq=hq, hkv=hkv, bs=16, d=d, evict={1: [0, 9]})
    nb, bs = case["k_cache"].shape[:2]
    store = KVStorage(nb, bs, hkv, d, dtype=name)
    slots = torch.arange(nb * bs)
    store.write(slots, case["k_cache"].reshape(-1, hkv, d), case["v_cache"].reshape(-1, hkv, d))
    deq = {**case, "k_cache": store.read_slots(slots, 0).view(nb, bs, hkv, d),
           "v_cache": store.read_slots(slots, 1).view(nb, bs, hkv, d)}
    feat = features(feature, case)
    args = [case[k] for k in ("table", "slot_pos", "q_pos", "scale")]
    out, mass = store.attend(fn, case["q"], *args, None, True, **feat)
    ref, ref_mass = reference_attention(deq, None, **feat)
    # the codes' scales multiply dot products, not codes: fp32 roundings reordered (~8)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mass.double(), ref_mass, atol=1e-5, rtol=1e-4)


def _prompt(prefix: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> tuple:
    """A chunk of t queries after `prefix` cached tokens: (case, q [T, Hq, D], its own
    k and v [T, Hkv, D] as the runner hands them: views of one fused projection)."""
    case = make_case([prefix], [t], hq=hq, hkv=hkv, bs=16, d=d, dtype=dtype)
    rows = case["k_cache"][case["table"][0]].reshape(-1, hkv, d)  # logical slot = position
    vals = case["v_cache"][case["table"][0]].reshape(-1, hkv, d)
    fused = torch.cat([case["q"][0], rows[prefix : prefix + t], vals[prefix : prefix + t]], 1)
    return case, fused[:, :hq], fused[:, hq : hq + hkv], fused[:, hq + hkv :]


@pytest.mark.parametrize("fn", [pytest.param(causal_self_attention, id="torch"),
                                pytest.param(causal_prefill_cpu, id="op", marks=needs_kernel)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(37, 4, 2, 32), (16, 8, 2, 64), (5, 2, 1, 128)])
@pytest.mark.parametrize("feature", ["softcap", "sinks", "both"])
def test_a_fresh_prompt(fn, dtype: torch.dtype, t: int, hq: int, hkv: int, d: int,
                        feature: str) -> None:
    """A prompt with nothing cached attends causally over its own keys: the C++ op
    where it runs (AVX-512: both loops of bf16, a tail of queries), the explicit softmax
    elsewhere; `out` given, as the runner gives it."""
    case, q, k, v = _prompt(0, t, hq, hkv, d, dtype)
    feat = features(feature, case)
    out = torch.empty(t, hq, d, dtype=dtype)
    got = fn(q, k, v, case["scale"], out=out, **feat)
    ref, _ = reference_attention({**case, "q": case["q"].float(), "k_cache": case["k_cache"].float(),
                                  "v_cache": case["v_cache"].float()}, None, **feat)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.double(), ref[0], atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("prefix", "t"), [(20, 13), (32, 16), (5, 40)])
@pytest.mark.parametrize("feature", ["softcap", "sinks", "both"])
def test_a_chunk_after_a_cached_prefix(dtype: torch.dtype, prefix: int, t: int,
                                       feature: str) -> None:
    """`prefix_prefill_cpu`: the prefix read from the pool in place (a prefix padded to
    whole chunks, or not), the chunk's own keys causal."""
    if not prefix_prefill_runs(dtype, 32, dtype, False):
        pytest.skip("the causal op needs an AVX-512 build")
    case, q, k, v = _prompt(prefix, t, 4, 2, 32, dtype)
    feat = features(feature, case)
    out, _ = prefix_prefill_cpu(q, case["k_cache"], case["v_cache"], k, v, case["table"][0],
                                case["slot_pos"][0], prefix, case["scale"], **feat)
    ref, _ = reference_attention({**case, "q": case["q"].float(), "k_cache": case["k_cache"].float(),
                                  "v_cache": case["v_cache"].float()}, None, **feat)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref[0], atol=tol, rtol=tol)


@needs_kernel
def test_bad_features_are_refused() -> None:
    case = make_case([4, 9], [1, 1])
    with pytest.raises(RuntimeError, match="sinks must be float32"):
        paged_attention_cpu(**case, sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="sinks must be float32"):
        paged_attention_cpu(**case, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="softcap must be"):
        paged_attention_cpu(**case, softcap=-1.0)


class _Sinks(torch.nn.Module):
    """A model's part of the contract: `attention_sinks(layer)`, a logit per query head
    (gpt-oss's `self.sinks`), here on odd layers only."""

    def __init__(self, layers: int, heads: int) -> None:
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.arange(layers * heads, dtype=torch.bfloat16)
                                        .view(layers, heads))

    def attention_sinks(self, layer: int) -> torch.Tensor | None:
        return self.sinks[layer] if layer % 2 else None


def test_layer_features_ask_the_model_and_the_config() -> None:
    """Per layer: `softcap` from the config, `sinks` from the model (fp32), nothing for a
    plain model; sinks of the wrong shape are a clear error, not a wrong answer."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", family="llama", num_layers=3,
                      hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=261,
                      max_position_embeddings=256, sliding_windows=[None] * 3,
                      eos_token_ids=[2], dtype=torch.float32,
                      hf_config=make_tiny_config("llama"))
    assert layer_features(torch.nn.Linear(1, 1), cfg) == [{}, {}, {}]
    cfg.attn_softcap = 30.0
    feat = layer_features(_Sinks(3, 4), cfg)
    assert [sorted(f) for f in feat] == [["softcap"], ["sinks", "softcap"], ["softcap"]]
    assert feat[1]["softcap"] == 30.0 and feat[1]["sinks"].dtype == torch.float32
    assert feat[1]["sinks"].tolist() == [4.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match=r"layer 1's attention sinks are \(5,\), not \[4\]"):
        layer_features(_Sinks(3, 5), cfg)


def test_per_head_pool_rows_take_their_heads_sinks() -> None:
    """Over a per-head pool the kernels see sequence b's kv head h as row h·B + b with
    that head's G query heads: its sinks are the layer's sinks[h·G : (h+1)·G]."""
    sinks = torch.arange(8.0)
    rows = heads_features({"sinks": sinks, "softcap": 2.0}, heads=2, members=3)
    assert rows["softcap"] == 2.0
    assert rows["sinks"].tolist() == [[0, 1, 2, 3]] * 3 + [[4, 5, 6, 7]] * 3
    assert heads_features({}, 2, 3) == {}
