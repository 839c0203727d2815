"""CPU linear layouts chosen by timing them on this CPU (engine/linear_choice.py), kept per
machine fingerprint (engine/kernel_cache.py): what is measured and recorded, the cache
read back, re-measured on a changed fingerprint, survived when corrupt or unwritable, the
vendor rules as the fallback, and the chosen layers' answers. Tiny shapes: fast."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from engine import kernel_cache
from engine.cpu_linear import PackedLinear, PanelLinear, faster_linear, vendor_layout
from engine.linear_choice import (
    DECODE_WEIGHTS,
    MARGIN,
    PREFILL_ROWS,
    candidates,
    choose_linears,
    kernel_mode,
    laid_out,
    pack_linears,
    pick,
    row_weights,
)

TYPES = {"panels": PanelLinear, "onednn": PackedLinear, "dense": nn.Linear}


class Tiny(nn.Module):
    """Three layer shapes and an output head, as kvserve's models name theirs."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.ModuleList([nn.Linear(64, 96) for _ in range(2)])
        self.down = nn.Linear(96, 64, bias=False)
        self.lm_head = nn.Linear(64, 200, bias=False)
        self.to(dtype)

    def embedding_weight_names(self) -> tuple[str, str]:
        return "embed.weight", "lm_head.weight"

    def layers(self) -> list[nn.Module]:
        return [*self.up, self.down, self.lm_head]


def _same_as_f_linear(layer: nn.Module, ref: nn.Linear) -> None:
    """`layer` answers as `ref` (its dense original) does: fp32 to its rounding (the
    tolerance of tests/test_cpu_linear.py), bf16 within a bf16 ulp of the fp32 sum
    (tests/test_cpu_linear_panels.py's)."""
    torch.manual_seed(1)
    for rows in (1, 7, 40):
        x = torch.randn(rows, ref.in_features).to(ref.weight.dtype)
        want = nn.functional.linear(x.float(), ref.weight.float(),
                                    None if ref.bias is None else ref.bias.float())
        with torch.inference_mode():
            out = layer(x)
        assert out.dtype == ref.weight.dtype and out.shape == want.shape
        if out.dtype == torch.float32:
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        else:
            assert (out.float() - want.to(out.dtype).float()).abs().max() <= \
                want.abs().max() * 2 ** -7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_shape_is_measured_and_its_choice_recorded_with_its_times(choice_cache, dtype) -> None:
    model, ref = Tiny(dtype), Tiny(dtype)
    choices = choose_linears(model)
    assert [(c.out_features, c.in_features, c.layers, c.bias, c.head) for c in choices] == [
        (200, 64, 1, False, True), (96, 64, 2, True, False), (64, 96, 1, False, False)]
    for c, layer, want in zip(choices, [model.lm_head, model.up[0], model.down],
                              [ref.lm_head, ref.up[0], ref.down]):
        cands = candidates(want)
        assert cands[-1] == "dense" and len(cands) >= 2  # dense, and panels or oneDNN here
        assert c.source == "measured" and c.dtype == str(dtype).removeprefix("torch.")
        rows = [1, 8, 32, 64] if c.head else [1, 8, 32, 64, PREFILL_ROWS]
        assert set(c.times_ms) == set(cands)  # every candidate timed (some dropped early)
        for name, times in c.times_ms.items():
            assert all(t > 0 for t in times.values())
            if name in c.score_ms:  # timed at every row count, scored on the weights
                assert list(times) == rows
                w = row_weights(None, None, c.head)
                assert c.score_ms[name] == pytest.approx(sum(w[r] * times[r] for r in rows),
                                                         rel=1e-3, abs=1e-5)
            else:
                assert name in c.dropped and list(times) == rows[:len(times)]
        # the fastest, or the vendor rules' if within MARGIN of it (timed first: never dropped)
        best, rule = min(c.score_ms, key=c.score_ms.__getitem__), vendor_layout(want.weight)
        assert cands[0] == rule and rule in c.score_ms
        assert c.layout == best or (
            c.layout == rule and c.score_ms[rule] <= c.score_ms[best] * (1 + MARGIN))
        assert type(layer) is TYPES[c.layout]
        assert c.line().startswith(f"CPU linear: {c.out_features}x{c.in_features} ")
        assert "; measured" in c.line()
        _same_as_f_linear(layer, want)
    assert type(model.up[1]) is type(model.up[0])  # a shape's layers alike
    for want in ref.layers():  # every candidate answers alike, chosen or not
        for name in candidates(want):
            _same_as_f_linear(laid_out(name, want) or want, want)


def test_weights_favour_decode_rows_and_follow_the_engines_limits() -> None:
    full = row_weights(None, None, False)
    assert list(full) == [*DECODE_WEIGHTS, PREFILL_ROWS]
    assert sum(full.values()) == pytest.approx(1.0)
    assert sum(w for r, w in full.items() if r <= 64) >= 0.95
    assert list(row_weights(None, None, True)) == list(DECODE_WEIGHTS)  # the head: decode
    assert list(row_weights(16, 256, False)) == [1, 8, 256]
    assert list(row_weights(4, 4, False)) == [1, 4]
    assert sum(row_weights(16, 256, True).values()) == pytest.approx(1.0)


def test_the_vendor_rules_layout_stays_unless_another_is_clearly_faster() -> None:
    assert pick({"panels": 1.0, "onednn": 0.85, "dense": 2.0}, "panels")[0] == "onednn"
    kept, why = pick({"panels": 1.0, "onednn": 0.95, "dense": 2.0}, "panels")
    assert kept == "panels" and "within 10% of oneDNN" in why
    assert pick({"panels": 1.0, "onednn": 1.2}, "onednn") == ("panels", "")
    assert pick({"panels": 1.0, "onednn": 1.2}, "panels") == ("panels", "")


def test_the_cache_is_written_and_read_back_on_the_same_fingerprint(choice_cache) -> None:
    first = choose_linears(Tiny())
    assert choice_cache.is_file()
    data = json.loads(choice_cache.read_text())
    (machine,) = data["machines"].values()
    fp = machine["fingerprint"]
    assert fp["threads"] == torch.get_num_threads() and fp["torch"] == torch.__version__
    assert {"cpu", "cpu_flags", "panels_build", "panels_isa", "scheme"} <= set(fp)
    assert set(machine["shapes"]) == {c.key for c in first}
    model = Tiny()
    again = choose_linears(model)
    assert [c.source for c in again] == ["cached"] * 3
    for a, b in zip(first, again):  # the first start's times, not new ones
        assert (b.key, b.layout, b.times_ms, b.score_ms, b.dropped) == (
            a.key, a.layout, a.times_ms, a.score_ms, a.dropped)
        assert "; cached" in b.line()
    assert type(model.lm_head) is TYPES[again[0].layout]
    _same_as_f_linear(model.lm_head, Tiny().lm_head)


def test_a_changed_fingerprint_measures_again(choice_cache) -> None:
    choose_linears(Tiny())
    torch.set_num_threads(2 if torch.get_num_threads() != 2 else 1)  # conftest restores it
    assert {c.source for c in choose_linears(Tiny())} == {"measured"}
    assert len(json.loads(choice_cache.read_text())["machines"]) == 2  # both kept
    # so does another scheme: fewer decode rows (max_num_seqs 16) are timed anew
    assert {c.source for c in choose_linears(Tiny(), max_seqs=16)} == {"measured"}


@pytest.mark.parametrize("text", ["{not json", '{"version": 99, "machines": {}}', "[1, 2]"])
def test_a_corrupt_cache_is_ignored_with_a_warning(choice_cache, caplog, text: str) -> None:
    choice_cache.parent.mkdir(parents=True)
    choice_cache.write_text(text)
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        choices = choose_linears(Tiny())
    assert {c.source for c in choices} == {"measured"}
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    data = json.loads(choice_cache.read_text())  # written anew, whole
    assert data["version"] == kernel_cache.VERSION and len(data["machines"]) == 1


def test_a_bad_record_is_measured_again(choice_cache) -> None:
    """A record of this fingerprint that is not whole, or names a layout this CPU cannot
    run, is measured again (and replaced)."""
    first = choose_linears(Tiny())
    data = json.loads(choice_cache.read_text())
    (machine,) = data["machines"].values()
    machine["shapes"][first[0].key] = {"layout": "panels"}  # no times
    machine["shapes"][first[1].key]["layout"] = "tiles"  # not a layout
    choice_cache.write_text(json.dumps(data))
    assert [c.source for c in choose_linears(Tiny())] == ["measured", "measured", "cached"]
    assert [c.source for c in choose_linears(Tiny())] == ["cached"] * 3


def test_an_unwritable_cache_never_fails_a_start(tmp_path, monkeypatch, caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(blocker / "cpu_kernels.json"))  # under a file
    monkeypatch.delenv("KVSERVE_KERNEL_CHOICE", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        choices = choose_linears(Tiny())
    assert {c.source for c in choices} == {"measured"}
    assert any("not written" in r.getMessage() for r in caplog.records)


def test_the_cache_path_respects_xdg_and_the_override(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVSERVE_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.cache_path() == tmp_path / "xdg" / "kvserve" / "cpu_kernels.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.cache_path() == tmp_path / "home" / ".cache" / "kvserve" / "cpu_kernels.json"
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path / "k.json"))
    assert kernel_cache.cache_path() == tmp_path / "k.json"


@pytest.mark.parametrize("how", ["argument", "environment"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vendor_mode_makes_the_vendor_rules_choices(choice_cache, monkeypatch, how: str,
                                                    dtype: torch.dtype) -> None:
    if how == "environment":
        monkeypatch.setenv("KVSERVE_KERNEL_CHOICE", "vendor")
    model = Tiny(dtype)
    want = [type(faster_linear(m) or m) for m in Tiny(dtype).layers()]
    choices = choose_linears(model, "vendor" if how == "argument" else None)
    assert [type(m) for m in model.layers()] == want
    assert {c.source for c in choices} == {"vendor"} and not choice_cache.exists()
    assert pack_linears(Tiny(dtype), "vendor") == sum(t is not nn.Linear for t in want)


def test_shapes_past_the_budget_take_the_vendor_rule(choice_cache) -> None:
    model = Tiny()
    want = [type(faster_linear(m) or m) for m in Tiny().layers()]
    choices = choose_linears(model, budget_s=0.0)
    assert {c.source for c in choices} == {"vendor"}
    assert all("budget" in c.reason for c in choices)
    assert [type(m) for m in model.layers()] == want and not choice_cache.exists()


def test_an_unknown_mode_is_refused(monkeypatch) -> None:
    with pytest.raises(ValueError, match="measure, vendor"):
        kernel_mode("fastest")
    monkeypatch.setenv("KVSERVE_KERNEL_CHOICE", "vendor")
    assert kernel_mode() == "vendor" and kernel_mode("measure") == "measure"
    monkeypatch.delenv("KVSERVE_KERNEL_CHOICE")
    assert kernel_mode() == "measure"


def test_an_engine_measures_its_layers_and_reports_them(choice_cache, tmp_path) -> None:
    """An engine on the default (measure) generates what dense weights do, keeps its
    choices, and hands them to the server in its CoreInfo."""
    from engine.sampling import SamplingParams
    from scheduler.core_loop import CoreLoop
    from scheduler.llm import LLM
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "llama")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5 + (3 * i + j) % 200 for j in range(11 + 9 * i)] for i in range(3)]
    llm = LLM(model, num_blocks=128, block_size=4, device="cpu", max_num_seqs=16)
    dense = LLM(model, num_blocks=128, block_size=4, device="cpu", cpu_prepack=False)
    choices = llm.engine.linear_choices
    assert choices and {c.source for c in choices} <= {"measured", "only"}
    for c in choices:  # max_num_seqs 16: decode rows 1 and 8 (and a prefill chunk)
        assert all(set(t) <= {1, 8, 512} for t in c.times_ms.values())
    assert dense.engine.linear_choices == []
    assert [c.token_ids for c in llm.generate(prompts, params)] == \
        [c.token_ids for c in dense.generate(prompts, params)]
    info = CoreLoop(llm.engine, warmup=False).info()
    assert info.linear_choices == [c.as_dict() for c in choices]
    assert {"shape", "layout", "source", "times_ms", "score_ms"} <= set(info.linear_choices[0])
    again = LLM(model, num_blocks=128, block_size=4, device="cpu", max_num_seqs=16)
    assert {c.source for c in again.engine.linear_choices} <= {"cached", "only"}
