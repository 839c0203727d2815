"""The attention variants (Gemma 2's soft-capping, gpt-oss's learned sinks) in the Triton
kernels, on CPU through TRITON_INTERPRET (fp32 maths), against the model classes' maths
(`tests.attention_cases.reference_attention`, float64; the CPU paths' tests:
tests/test_attention_features.py).

What each kernel must get right: the decode kernel and the general one cap each tile's
scores in log2 units; only split 0 of a split-KV row counts the sink, so the merge and
the row's log-sum-exp hold it once, and the mass pass, which divides by that log-sum-exp
and caps its own scores again, returns the real softmax's probabilities; a CUDA graph's
call (fixed-width tables read to `slot_count`, the mass summed over heads for flagged
rows) and a quantized pool take the same flags. Shapes are tiny: the interpreter runs
every program in Python.
"""

from __future__ import annotations

import pytest
import torch

from attention.storage import KVStorage
from attention.torch_attention import PAD_QUERY_POS
from tests.attention_cases import DEV, make_case, reference_attention

pytest.importorskip("triton")
triton_attention = pytest.importorskip("attention.triton_attention")
paged_attention_triton = triton_attention.paged_attention_triton

TOL = 1e-5
FEATURES = ["softcap", "sinks", "row_sinks", "both"]


def features(name: str, case: dict, seed: int = 1) -> dict:
    """As tests/test_attention_features.py's: a cap that bends ~N(0, 1) scores, sinks
    around the scores' size ([Hq], or [B, Hq] for row_sinks)."""
    b, _, hq, _ = case["q"].shape
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    if name in ("softcap", "both"):
        out["softcap"] = 1.5
    if name in ("sinks", "both"):
        out["sinks"] = (torch.randn(hq, generator=g) * 2).to(DEV)
    if name == "row_sinks":
        out["sinks"] = (torch.randn(b, hq, generator=g) * 2).to(DEV)
    return out


def check(case: dict, feat: dict, window: int | None = None, **kw) -> None:
    """Output and mass (per kv head, or summed with `sum_heads`) of the query rows that
    are not padding, against the reference."""
    out, mass = paged_attention_triton(**case, window=window, return_probs=True, **feat, **kw)
    ref, ref_mass = reference_attention(case, window, **feat)
    if kw.get("sum_heads"):
        ref_mass = ref_mass.sum(dim=2, keepdim=True)
    real = (case["q_pos"] < PAD_QUERY_POS).cpu()
    torch.testing.assert_close(out.cpu()[real].double(), ref[real], atol=TOL, rtol=TOL)
    torch.testing.assert_close(mass.cpu()[real].double(), ref_mass[real], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 8), (6, 2, 12), (2, 2, 16)])
@pytest.mark.parametrize("decode", [True, False])
def test_decode_rows(feature: str, hq: int, hkv: int, d: int, decode: bool) -> None:
    """One query a row through the decode kernel and the general one: a group of 3
    padded to 16 rows, a head dim padded, evicted slots, a row that sees only itself."""
    case = make_case([70, 9, 0], [1, 1, 1], bs=8, hq=hq, hkv=hkv, d=d, extra_blocks=1,
                     evict={0: [1, 2, 6, 40], 1: [0, 3]})
    check(case, features(feature, case), decode=decode)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("decode", [True, False])
def test_split_kv_counts_the_sink_once(feature: str, decode: bool) -> None:
    """Forced splits (the short row leaves splits empty) under a window: the merge."""
    case = make_case([149, 36], [1, 1], bs=8, hq=4, hkv=2)
    feat = features(feature, case)
    check(case, feat, num_splits=3, decode=decode)
    check(case, feat, window=70, num_splits=3, decode=decode)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("window", [None, 5])
def test_prefill_chunks_over_a_cached_prefix(feature: str, window: int | None) -> None:
    """Chunks of 7, 16 and 3 queries after prefixes of 0, 5 and 20 (several row tiles
    of G·Tq rows, padding rows), with the mass."""
    case = make_case([0, 5, 20], [7, 16, 3], bs=4, hq=4, hkv=2)
    check(case, features(feature, case), window)
    check(case, features(feature, case), window, num_splits=2)


@pytest.mark.parametrize("feature", ["softcap", "sinks", "both"])
def test_a_graph_call(feature: str) -> None:
    """As engine/cuda_graphs.py calls it: tables wider than the step whose stale columns
    would be visible (`slot_count`), the mass summed over every head, and only for the
    rows flagged (`mass_rows`); a flagged row's mass sums to less than its heads' count
    when the sink took its share."""
    case = make_case([149, 36, 20], [1, 1, 1], bs=8, hq=4, hkv=2, extra_blocks=3)
    count = 64
    stale = {**case, "slot_pos": case["slot_pos"].clone(), "table": case["table"].clamp(min=0)}
    stale["slot_pos"][:, count:] = torch.arange(count, stale["slot_pos"].shape[1])
    feat = features(feature, case)
    rows = torch.tensor([1, 0, 1], dtype=torch.int32, device=DEV)
    out, mass = paged_attention_triton(**stale, return_probs=True, sum_heads=True, mass_rows=rows,
                                       slot_count=torch.tensor([count], device=DEV), **feat)
    cut = {**case, "table": case["table"][:, : count // 8], "slot_pos": case["slot_pos"][:, :count]}
    ref, ref_mass = reference_attention(cut, None, **feat)
    torch.testing.assert_close(out.cpu().double(), ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(mass.cpu()[[0, 2], ..., :count].double(),
                               ref_mass.sum(dim=2, keepdim=True)[[0, 2]], atol=TOL, rtol=TOL)
    assert not mass[1].any() and not mass[..., count:].any()
    total = mass.sum(-1).flatten().cpu()
    assert total[1] == 0
    if "sinks" in feat:
        assert (total[[0, 2]] < 4 - 1e-3).all()
    else:
        torch.testing.assert_close(total[[0, 2]], torch.full((2,), 4.0))


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("tq", [1, 3])
def test_quantized_pools(name: str, tq: int) -> None:
    """Soft-capping and sinks over a quantized pool (codes decoded as each tile loads):
    the reference reads the same dequantized values."""
    case = make_case([3, 40], [tq, tq], bs=8, hq=4, hkv=2, d=16, evict={1: [0, 9]})
    nb, bs, hkv, d = case["k_cache"].shape
    store = KVStorage(nb, bs, hkv, d, dtype=name, device=DEV)
    slots = torch.arange(nb * bs, device=DEV)
    store.write(slots, case["k_cache"].reshape(-1, hkv, d), case["v_cache"].reshape(-1, hkv, d))
    deq = {**case, "k_cache": store.read_slots(slots, 0).view(nb, bs, hkv, d),
           "v_cache": store.read_slots(slots, 1).view(nb, bs, hkv, d)}
    feat = features("both", case)
    args = [case[k] for k in ("table", "slot_pos", "q_pos", "scale")]
    out, mass = store.attend(paged_attention_triton, case["q"], *args, None, True, **feat)
    ref, ref_mass = reference_attention(deq, None, **feat)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mass.cpu().double(), ref_mass, atol=1e-5, rtol=1e-4)
