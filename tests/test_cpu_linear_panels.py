"""Linear layers in 16-column panels for kvserve's own kernel (engine/cpu_linear.py's
`PanelLinear`, engine/csrc/linear_panels.h): F.linear's answers, the argmax of a panel head,
and where the panels are chosen (oneDNN's prepacked layers: tests/test_cpu_linear.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from engine import cpu_linear
from engine.cpu_linear import PanelLinear
from engine.sampling import SamplingParams
from native.cpu import pair_fma, prefetch_from, whole_k_to
from scheduler.llm import LLM
from tests.isa import cpu_has as isa_has
from tests.isa import expected_path
from tests.panels import LAYOUTS, needs_panels
from tests.tiny_models import make_tiny_model


@needs_panels
@LAYOUTS
@pytest.mark.parametrize("bias", [False, True])
# AVX2: 1-72 decoding, whole K in registers (tile tails of 1-5 rows), 73 and up blocked (a
# 144-row block and a tail). AVX-512: 1-12 whole K (one tile), 13-144 one block packed by
# each thread, 145 and up blocks packed together. K 400: a 384 block and a 16 tail.
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 11, 12, 13, 17, 32, 33, 72, 73, 144, 145, 150, 300])
def test_panel_linear_matches_f_linear(dtype: torch.dtype, pairs: bool, fma: bool,
                                       bias: bool, rows: int) -> None:
    """The panels give F.linear's result in the weight's own dtype: fp32 to its rounding,
    bf16 as the fp32 sum of the same bf16 products (bias added in fp32) rounded once,
    widened as read or in pairs (bf16 dot products where the CPU has them, the same sums
    in a plain loop elsewhere; with `fma`, steps of 6 rows and more by FMAs over the
    pairs widened: whole K up to 32, packed blocks past it). K 800 in pairs: a block of
    384 pairs and a 16 tail."""
    torch.manual_seed(rows)
    k = 800 if pairs else 400
    linear = nn.Linear(k, 72, bias=bias).to(dtype)  # 72 outputs: 4.5 panels
    layer = PanelLinear(linear, pairs=pairs, fma=fma)
    assert layer.pairs == pairs and layer.fma == fma and layer.panels.dtype == dtype
    assert layer.panels.shape == ((5, 400, 16, 2) if pairs else (5, 400, 16))
    if pairs:  # column 16p + j's weights for inputs 2i, 2i + 1 side by side
        w = linear.weight.detach()
        assert torch.equal(layer.panels[1, 7, 3], w[16 + 3, 14:16])
        assert torch.equal(layer.panels[4, 399, 7], w[64 + 7, 798:800])
        assert not layer.panels[4, :, 8:].any()  # past the 72nd output: zeros
    x = torch.randn(2, rows, k).to(dtype)  # leading dims, as the models' [T, h]
    with torch.inference_mode():
        out = layer(x)
        for pf in (1, 6):  # from which rows the next panel is prefetched: no bit moves
            layer.prefetch_from = pf
            assert torch.equal(layer(x), out)
        for whole in (0, 5):  # up to which rows a step runs whole K (then packed): none
            layer.whole_k_to = whole
            assert torch.equal(layer(x), out)
    assert out.shape == (2, rows, 72) and out.dtype == dtype
    want = torch.nn.functional.linear(x.float(), linear.weight.float(),
                                      None if linear.bias is None else linear.bias.float())
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    elif rows:  # one rounding of (nearly) the same fp32 sum: at most one bf16 ulp apart
        assert (out.float() - want.to(dtype).float()).abs().max() <= want.abs().max() * 2 ** -7


@needs_panels
@LAYOUTS
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k", [96, 800])  # one K block a panel; several (fp32: C-wide scratch)
def test_panel_argmax_is_the_outputs_first_maximum(dtype: torch.dtype, pairs: bool, fma: bool,
                                                   bias: bool, threads: int, k: int) -> None:
    """`PanelLinear.argmax` (the op's running maximum over its tiles as they finish, the
    output never written) is `forward(x).float().max(dim=-1).indices`: the first of
    equal maxima, whether they meet in one lane of two panels (side by side in a wide
    tile, compared there first, or apart), in two lanes, or in two threads' shares of the
    panels; with NaN columns (from the bias) the first NaN, over any larger value; a row
    of -inf gives 0; every step shape (whole K, one block, blocks and a tail) at one K
    block a panel and at several (the finishing scratch a pair of panels wide, or as
    wide as the output), a last panel cut short (1,000 outputs: 62.5 panels), one to
    three threads."""
    torch.manual_seed(threads)
    torch.set_num_threads(threads)  # restored by conftest's fixture
    linear = nn.Linear(k, 1000, bias=bias).to(dtype)
    with torch.no_grad():
        w = linear.weight
        w[700] = w[3] = w[3] * 4  # column 3 the largest of its rows, and 700 equal to it
        w[19] = w[3]  # and 19: lane 3 of the next panel, compared in the same wide tile
        w[517] = w[21] = w[21] * 4  # lanes 5 and 5 of panels 1 and 32
        w[999] = w[9]  # the short last panel's lane 7
        if bias:
            linear.bias[:] = 0
    layer = PanelLinear(linear, pairs=pairs, fma=fma)
    x = torch.randn(300, k).to(dtype)
    x[41] = 0  # a row of zeros: every column equal, the first wins

    def check() -> torch.Tensor:
        for rows in (1, 5, 12, 13, 64, 150, 300):
            with torch.inference_mode():
                want = layer(x[:rows]).float().max(dim=-1).indices
                got = layer.argmax(x[:rows])
            assert got.dtype == torch.int64 and torch.equal(got, want), rows
        return want

    want = check()
    assert want[41] == 0 and {3, 21} <= set(want.tolist())  # the ties met: the first won
    if bias:
        with torch.no_grad():
            layer.bias[998] = layer.bias[517] = float("nan")  # two NaN columns: the first
            layer.bias[3] = 1e30  # beside a larger column before them
        assert set(check().tolist()) == {517}
        with torch.no_grad():
            layer.bias[:] = float("-inf")  # rows of -inf: the first column
        assert set(check().tolist()) == {0}


@needs_panels
@LAYOUTS
@pytest.mark.parametrize("rows", [1, 13, 300])  # whole K; one block; blocks and a tail
def test_panels_round_each_output_as_torch_does(dtype: torch.dtype, pairs: bool, fma: bool,
                                                rows: int) -> None:
    """Each tile's sums are finished (bias added, rounded) as soon as they are whole, into
    the output: sums made exact by construction come out bit for bit as torch rounds them.
    In bf16 the half-way sums 1 + 2^-8, 1 + 3 * 2^-8 and 1 - 3 * 2^-9 go to the even
    neighbour, a bias is added before the one rounding (1 + 2^-8 + 2^-8 is 1 + 2^-7, not
    1), a NaN in the input is the quiet 0x7FC0 and an infinity stays one; columns past
    the last whole panel (N 40) and a K block's tail (K 800) are on the way."""
    k, n = 800, 40
    w = torch.zeros(n, k)
    w[:, 0] = 1.0
    w[:, 1] = torch.tensor([2.0 ** -8, 3 * 2.0 ** -8, 2.0 ** -8, -3 * 2.0 ** -9] * 10)
    w[:, 799] = 2.0 ** -9  # the last pair of the K tail: only where the input has it
    linear = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(torch.tensor([0.0, 0.0, 2.0 ** -8, 0.0] * 10))
    linear = linear.to(dtype)
    x = torch.zeros(rows, k)
    x[:, :2] = 1.0
    x[1::3, 799] = 1.0
    x[2::5, 0] = float("nan")
    x[3::7, 1] = float("inf")
    x = x.to(dtype)
    with torch.inference_mode():
        out = PanelLinear(linear, pairs=pairs, fma=fma)(x)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(),
                                      linear.bias.float()).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], want[~nan])  # exact, ties to even, infinities kept
    if dtype == torch.bfloat16:
        assert (out[nan].view(bits) == 0x7FC0).all()
        assert torch.equal(out[0, :4].float(), torch.tensor([1.0, 1 + 2.0 ** -6, 1 + 2.0 ** -7, 1 - 2.0 ** -7]))


@needs_panels
@pytest.mark.parametrize("rows", [8, 20, 40])
def test_fmas_over_pairs_with_k_not_in_groups_of_32(rows: int) -> None:
    """A whole-K step of FMAs over pairs widens the input 16 pairs at a time, so K must be
    a multiple of 32; a layer whose K is not (784 here) keeps the dot products up to 32
    rows (the same bits as without `fma`) and takes FMAs past them, F.linear's answer
    either way."""
    torch.manual_seed(rows)
    linear = nn.Linear(784, 40, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 784).to(torch.bfloat16)
    with torch.inference_mode():
        by_fma = PanelLinear(linear, pairs=True, fma=True)(x)
        dots = PanelLinear(linear, pairs=True, fma=False)(x)
    if rows <= 32:
        assert torch.equal(by_fma, dots)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    for out in (by_fma, dots):
        assert (out.float() - want.bfloat16().float()).abs().max() <= want.abs().max() * 2 ** -7


@needs_panels
@pytest.mark.parametrize("dtype,pairs,fma", [(torch.float32, False, False),
                                             (torch.bfloat16, True, False),
                                             (torch.bfloat16, True, True)])
def test_a_row_comes_out_the_same_in_any_batch(dtype: torch.dtype, pairs: bool,
                                               fma: bool) -> None:
    """A row's outputs do not depend on how many rows share the step: every register tile,
    whatever its height (one tile up to 16 rows, then the rows shared evenly among a
    step's tiles: 17 rows run as 9 + 8, 25 as 9 + 9 + 7), sums its products in k order. Continuous batching relies on it
    (a request's tokens must not change with the batch it lands in); K 1,600 in pairs:
    several K blocks, whose partial sums go through C. With `fma` (pairs: 1-5 rows by
    bf16 dot products, 6-32 by whole-K FMAs over weights widened in registers, 33 and up
    by FMAs over packed blocks) the FMAs add each pair's products in the dot product's
    order, each rounded, as Intel defines `vdpbf16ps` (the CPUs `pair_fma` picks) and as
    the plain loop does without the instruction."""
    if fma and cpu_linear.panels_isa() == "avx512_bf16" and not pair_fma():
        pytest.skip("FMAs over pairs run on Intel only; another vendor's dot product may "
                    "round a pair's two products once")
    torch.manual_seed(0)
    k = 1600 if pairs else 800
    linear = nn.Linear(k, 72, bias=True).to(dtype)
    layer = PanelLinear(linear, pairs=pairs, fma=fma)
    x = torch.randn(300, k).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(0, 300, 23)])
        for rows in (1, 5, 6, 8, 12, 13, 15, 16, 17, 25, 32, 33, 40, 64, 143, 145, 300):
            batch = layer(x[:rows])[::23]
            assert torch.equal(batch, alone[:len(batch)]), rows


@needs_panels
def test_panels_with_sleeping_threads_match_f_linear() -> None:
    """Where the intra-op threads sleep (`--cpu-wait passive`, read by the kernel once
    per process) each thread packs every block of a long step for itself instead of
    sharing it across barriers: the same result, in a process started that way (fp32,
    and bf16 in pairs)."""
    from loadtest.spawn import python_path

    code = ("import torch\nfrom engine.cpu_linear import PanelLinear\n"
            "torch.manual_seed(0)\nlin = torch.nn.Linear(400, 72)\n"
            "with torch.inference_mode():\n"
            "    for rows in (13, 145, 300, 1000):\n"
            "        x = torch.randn(rows, 400)\n"
            "        torch.testing.assert_close(PanelLinear(lin)(x), lin(x), atol=1e-5, rtol=1e-5)\n"
            "lin = torch.nn.Linear(800, 72).to(torch.bfloat16)\n"  # pairs: 384 and 16 of K
            "with torch.inference_mode():\n"
            "    for rows in (13, 145, 1000):\n"
            "        x = torch.randn(rows, 800).to(torch.bfloat16)\n"
            "        want = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())\n"
            "        err = (PanelLinear(lin, pairs=True)(x).float() - want).abs().max()\n"
            "        assert err <= want.abs().max() * 2 ** -7, err\n"
            "print('ok')")
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_WAIT_POLICY": "PASSIVE",
           "GOMP_SPINCOUNT": "0", "KVSERVE_TEAM_SPIN_US": "0", "OMP_NUM_THREADS": "2"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_a_panel_layer_made_directly_loads_its_op() -> None:
    """A fresh process that makes a `PanelLinear` itself, as bench_linear_rows does for
    both layouts on any CPU (not through `pack_linears`, which loads the op while
    choosing), gets F.linear's answer: the layer loads its op."""
    from loadtest.spawn import python_path
    from native.build import load_ops

    if not load_ops("kvserve_layer_ops_cpu"):
        pytest.skip("no C++ compiler")
    code = ("import torch\nfrom engine.cpu_linear import PanelLinear\n"
            "torch.manual_seed(0)\nlin = torch.nn.Linear(32, 20)\nx = torch.randn(3, 32)\n"
            "with torch.inference_mode():\n"
            "    torch.testing.assert_close(PanelLinear(lin)(x), lin(x), atol=1e-5, rtol=1e-5)\n"
            "print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": python_path()})
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


@needs_panels
def test_panel_op_refuses_what_it_cannot_run() -> None:
    op = torch.ops.kvserve_layer.linear_panels
    panels = torch.zeros(2, 32, 16)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.bfloat16)

    assert op(bf16(3, 32), bf16(2, 16, 16, 2), None, 20).shape == (3, 20)  # pairs run
    for x, w, n in ((torch.zeros(3, 32, dtype=torch.bfloat16), panels, 20),  # dtypes differ
                    (torch.zeros(3, 31), panels, 20),  # K differs
                    (torch.zeros(3, 32), panels, 16),  # n: fewer than the panels hold
                    (torch.zeros(3, 32), panels, 33),  # n: more
                    (torch.zeros(32, 3).t(), panels, 20),  # not contiguous
                    (torch.zeros(3, 32), torch.zeros(2, 32, 8), 20),  # not 16 columns
                    (torch.zeros(3, 32), torch.zeros(2, 16, 16, 2), 20),  # fp32 in pairs
                    (bf16(3, 32), bf16(2, 32, 16, 2), 20),  # K: pairs hold 64
                    (bf16(3, 32), bf16(2, 8, 16, 4), 20)):  # not pairs
        with pytest.raises(RuntimeError, match="linear_panels takes"):
            op(x, w, None, n)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.zeros(3, 32), panels, torch.zeros(19), 20)


def test_panels_where_they_were_measured_faster() -> None:
    """The kernel's vector loop follows the build's ISA, and a layer takes the panels
    where they beat oneDNN: every fp32/bf16 layer on AVX2 without AVX-512, fp32 only on
    an AMD CPU with AVX-512 (bf16 there too where the build has the pair tile's bf16 dot
    products), the same on an Intel CPU with AVX-512 but no AMX, nothing where it has AMX
    (not measured)."""
    from native.build import load_ops

    if not load_ops("kvserve_layer_ops_cpu"):
        assert not cpu_linear.panels_available() and not cpu_linear.panels_for(torch.float32)
        return
    isa = cpu_linear.panels_isa()
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    path = {"portable": "scalar"}.get(expected_path(), expected_path())
    assert isa == (path + "_bf16" if path == "avx512" and isa_has("avx512_bf16") else path)
    assert cpu_linear.panels_available() == (isa != "scalar")
    assert not cpu_linear.panels_for(torch.float16)
    for vendor, amx in (("AuthenticAMD", False), ("GenuineIntel", False),
                        ("GenuineIntel", True), ("HygonGenuine", False)):
        fp32, bf16 = (cpu_linear.panels_for(d, vendor, amx) for d in (torch.float32, torch.bfloat16))
        if isa == "scalar":
            assert not fp32 and not bf16
        elif not avx512:
            assert fp32 and bf16
        else:
            measured = vendor == "AuthenticAMD" or (vendor == "GenuineIntel" and not amx)
            assert fp32 == (measured and isa.startswith("avx512"))
            assert bf16 == (measured and isa == "avx512_bf16")
    assert pair_fma("GenuineIntel") and not pair_fma("AuthenticAMD")
    assert prefetch_from("GenuineIntel") == 1 and prefetch_from("AuthenticAMD") == 6
    assert whole_k_to("GenuineIntel") == 5 and whole_k_to("GenuineIntel", avx512=False) == 0
    assert whole_k_to("AuthenticAMD") == 0


@needs_panels
def test_a_panel_layer_takes_this_cpus_kernel_choices() -> None:
    """Every panel layer runs on the choices native/build.py makes for this CPU (read
    once), and says whether a pair layer's longer steps run on FMAs."""
    avx512 = cpu_linear.panels_isa().startswith("avx512")
    layer = PanelLinear(nn.Linear(64, 32).to(torch.bfloat16), pairs=True, fma=True)
    assert (layer.prefetch_from, layer.whole_k_to) == (prefetch_from(), whole_k_to(avx512=avx512))
    assert "FMAs" in repr(layer)
    plain = PanelLinear(nn.Linear(64, 32).to(torch.bfloat16), pairs=True)
    assert plain.fma == pair_fma() and ("FMAs" in repr(plain)) == pair_fma()


@needs_panels
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_steps_take_the_argmax_from_a_panel_head(tmp_path, monkeypatch, dtype: str) -> None:
    """A panel head (bf16 or fp32) gives a greedy step's tokens without its logits
    (`PanelLinear.argmax`, the runner's `greedy`): the same tokens as the logits'
    argmax, for every step of greedy requests, and not while a sampled request (which
    needs the logits) shares the batch."""
    from engine.models import causal_lm

    if not cpu_linear.panels_for(getattr(torch, dtype)):
        pytest.skip(f"{dtype} layers stay on oneDNN on this CPU")
    monkeypatch.setattr(cpu_linear, "PACK_MIN_ELEMENTS", 0)
    model = make_tiny_model("llama", tmp_path / "llama")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5 + (3 * i + j) % 200 for j in range(11 + 9 * i)] for i in range(4)]
    calls = []
    argmax = PanelLinear.argmax
    monkeypatch.setattr(PanelLinear, "argmax", lambda self, x: calls.append(len(x)) or argmax(self, x))
    fused = LLM(model, num_blocks=128, block_size=4, device="cpu", dtype=dtype,
                cpu_kernels="vendor")
    assert isinstance(fused.engine.model.lm_head, PanelLinear)
    got = [c.token_ids for c in fused.generate(prompts, greedy)]
    assert len(calls) >= 12 and max(calls) == 4  # every step, all four rows at once
    mixed = [greedy] * 3 + [SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)]
    calls.clear()
    got_mixed = [c.token_ids for c in fused.generate(prompts, mixed)][:3]
    assert not calls  # the sampled request ran as long as the others
    monkeypatch.setattr(causal_lm, "greedy_ids", lambda head, hidden: None)  # logits, then argmax
    plain = LLM(model, num_blocks=128, block_size=4, device="cpu", dtype=dtype,
                cpu_kernels="vendor")
    assert [c.token_ids for c in plain.generate(prompts, greedy)] == got
    assert got_mixed == got[:3]
