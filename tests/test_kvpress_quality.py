"""The kvpress rows of bench_policies' quality part (issue 20), without kvpress installed.

kvpress runs in its own venv (`benchmarks/kvpress_quality.py`); what kvserve's side does
with it — the exchange file, the skip note, turning its output into rows scored by the
needle harness's rule, the table and the figure — is checked here on small dicts. The
one test that runs kvpress itself is skipped where .venv-kvpress is missing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from argparse import Namespace

import pytest

from benchmarks import bench_policies_report, kvpress_compare, kvpress_quality, kvpress_report
from benchmarks.kvpress_quality import PRESSES, ratio_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(REPO, kvpress_compare.DEFAULT_PYTHON)
DEPTHS = ("0.00", "0.50", "1.00")


def _row(policy: str, budget: float, ppl: float, needle: float, **extra) -> dict:
    return {"policy": policy, "budget": budget, "ppl": ppl, "nll": math.log(ppl),
            "needle_mean": needle, "needle_by_depth": dict.fromkeys(DEPTHS, needle), **extra}


def _kv(method: str, press: str, budget: float, ppl: float, needle: float) -> dict:
    return _row("kvpress full" if method == "full" else f"kvpress {press}", budget, ppl,
                needle, method=method, protocol="prefill+decode",
                kv_policy={"press": press, "protocol": "prefill+decode"})


def _quality() -> dict:
    return {
        "model": "m", "windows": 2, "window": 64, "prompt": 32, "scored_tokens": 64,
        "full_matches_reference": True, "reference_ppl_transformers": 10.0,
        "needle": {"tasks": ["passkey/repeat"], "lengths": [128], "trials": 1},
        "rows": [_row("full", 1.0, 10.0, 1.0), _row("knorm", 0.25, 60.0, 0.0),
                 _row("paged_eviction", 0.25, 20.0, 0.0), _row("keydiff", 0.25, 13.0, 0.5)],
        "kvpress": {"versions": {"kvpress": "0.5.5", "transformers": "5.2.0"}, "rows": [
            _kv("full", "none", 1.0, 11.0, 1.0), _kv("knorm", "KnormPress", 0.25, 66.0, 0.0),
            _kv("keydiff", "KeyDiffPress", 0.25, 14.3, 0.5),
            _kv("keydiff@layer", "KeyDiffPress, head mean", 0.25, 14.3, 0.5)]}}


def test_ratio_keeps_exactly_the_budget() -> None:
    """kvpress keeps int(n·(1 − r)): the ratio we pass must land on B, not B − 1."""
    for n in (7, 64, 192, 256, 512, 513, 768, 1000):
        for b in range(1, n):
            assert int(n * (1 - ratio_for(n, b))) == b, (n, b)
    assert ratio_for(10, 10) == 0.0


def test_methods_are_the_presses_script() -> None:
    """One list on each side of the venv boundary, kept equal."""
    assert {m: p[0] for m, p in PRESSES.items()} == kvpress_compare.METHODS
    assert set(kvpress_compare.PER_HEAD) <= set(PRESSES)
    assert kvpress_compare.ADAKV == kvpress_quality.ADAKV


def test_adakv_wraps_the_presses_it_can() -> None:
    """AdaKVPress at our safeguard, around the scorer presses of our adaptive policies
    but h2o's (eager attention) and pyramid's (its budgets are not in its score)."""
    from benchmarks.policy_eval import ADAPTIVE_POLICIES
    from policies.heads import ALPHA

    assert kvpress_quality.ALPHA == ALPHA
    assert set(ADAPTIVE_POLICIES) - {"h2o", "pyramid"} <= set(kvpress_quality.ADAKV)
    assert set(kvpress_quality.ADAKV) <= set(PRESSES) - {"h2o", "pyramid"}
    assert kvpress_quality.press_name("knorm@adakv") == "AdaKVPress(KnormPress)"
    assert kvpress_quality.press_name("snapkv@layer") == "SnapKVPress, head mean"
    assert kvpress_quality.press_name("full") == "none"
    for bad in ("h2o@adakv", "pyramid@adakv", "knorm@nope", "nope"):
        with pytest.raises(ValueError):
            kvpress_quality.make_press(bad, 64, 16)


def test_adakv_rows_run_beside_our_adaptive_rows(monkeypatch) -> None:
    """`quality` asks for "<m>@adakv" only where the run has "<m>:adaptive", after the
    presses and their head-mean rankings, which stay as they were."""
    asked = []

    def fake_run(python, ex, methods, threads=1):
        asked.append(list(methods))
        return {"skipped": "test"}

    monkeypatch.setattr(kvpress_compare, "run", fake_run)
    args = Namespace(demo_model="m", ppl_prompt=2, quality_budgets=[0.25],
                     kvpress_python="python", policies=[
                         "knorm", "knorm:head", "knorm:adaptive", "h2o", "h2o:adaptive",
                         "snapkv", "tova", "tova:head", "paged_eviction:head"])
    kvpress_compare.quality(args, None, [[1, 2, 3]], [], {},
                            [n.partition(":")[0] for n in args.policies])
    assert asked == [["knorm", "tova", "snapkv", "h2o", "knorm@layer", "snapkv@layer",
                      "h2o@layer", "knorm@adakv"]]


def test_exchange_is_json_and_the_skip_is_a_note(tmp_path) -> None:
    ex = kvpress_compare.exchange("engine/demo/model", [[1, 2, 3]], 2, [0.25], [[4, 5]])
    assert json.loads(json.dumps(ex)) == ex and os.path.isabs(ex["model"])
    assert ex["max_new_tokens"] == 8  # demo_model.evaluate.needle's answer length
    gone = str(tmp_path / "no-python")
    assert "kvpress-venv" in kvpress_compare.run(gone, ex, ["knorm"])["skipped"]
    args = Namespace(demo_model="m", ppl_prompt=2, quality_budgets=[0.25], kvpress_python=gone)
    assert "skipped" in kvpress_compare.quality(args, None, [[1, 2, 3]], [], {}, ["knorm"])
    assert "no policy" in kvpress_compare.quality(args, None, [], [], {}, ["paged_eviction"])[
        "skipped"]


def test_rows_score_answers_with_the_harness(monkeypatch) -> None:
    """Answers go back through `needle` in order; the PPL comes from the NLL."""
    import demo_model.evaluate

    def fake_needle(backend, data, **kw):  # two prompts: right iff the answer is [7]
        hits = [backend.generate([0], 8) == [7] for _ in range(2)]
        return {"passkey/repeat": {"128": {"0.00": float(hits[0]), "1.00": float(hits[1])}}}

    monkeypatch.setattr(demo_model.evaluate, "needle", fake_needle)
    res = {"rows": [{"method": "knorm", "press": "KnormPress", "budget": 0.25,
                     "budget_tokens": 16, "protocol": "prefill+decode", "nll": math.log(5.0),
                     "max_cache_after_step": 16, "needle_answers": [[7], [3]], "wall_s": 1.0}]}
    (r,) = kvpress_compare.rows(res, None, {})
    assert r["policy"] == "kvpress KnormPress" and r["method"] == "knorm"
    assert r["ppl"] == pytest.approx(5.0)
    assert r["needle_by_depth"] == {"0.00": 1.0, "1.00": 0.0} and r["needle_mean"] == 0.5


def test_adakv_row_goes_after_our_adaptive_row() -> None:
    """Per head (issue 65): the press after `<m>:head`, AdaKVPress after `<m>:adaptive`,
    the head-mean ranking after our per-layer row; each pair compared as such."""
    q = _quality()
    q["rows"] += [_row("keydiff:head", 0.25, 12.0, 0.6), _row("keydiff:adaptive", 0.25, 12.5, 0.7)]
    q["kvpress"]["rows"].append(_kv("keydiff@adakv", "AdaKVPress(KeyDiffPress)", 0.25, 13.2, 0.8))
    names = [r["policy"] for r, _ in kvpress_report.interleave(q)]
    assert names[5:] == ["keydiff", "kvpress KeyDiffPress, head mean", "keydiff:head",
                         "kvpress KeyDiffPress", "keydiff:adaptive",
                         "kvpress AdaKVPress(KeyDiffPress)"]
    assert [(a["policy"], b["method"]) for a, b, _, _ in kvpress_report.pairs(q)][-3:] == [
        ("keydiff", "keydiff@layer"), ("keydiff:head", "keydiff"),
        ("keydiff:adaptive", "keydiff@adakv")]


def test_per_head_table_and_figure_put_kvpress_beside_ours(tmp_path, monkeypatch) -> None:
    """The per-head quality table has kvpress's per-head press and AdaKVPress columns
    (PPL / full of kvpress's own full); a quality-only per-head run's figure is the
    per-head one, its five series per budget, and no separate kvpress figure."""
    from benchmarks import bench_common as bc
    from benchmarks import heads_report

    q = _quality()
    q["rows"] += [_row("keydiff:head", 0.25, 12.0, 0.6), _row("keydiff:adaptive", 0.25, 12.5, 0.7)]
    q["kvpress"]["rows"].append(_kv("keydiff@adakv", "AdaKVPress(KeyDiffPress)", 0.25, 13.2, 0.8))
    text = "\n".join(heads_report.quality(q))
    assert "| kvpress, per head | kvpress AdaKV | needle:" in text
    assert "| keydiff | 25% | 1.300 | 1.200 | 1.250 | 1.300 | 1.200 | 50% | 60% | 70% | 50% | 80% |" in text
    assert "| knorm | 25% | 6.000 | — | — | 6.000 | — |" in text
    figures = []
    monkeypatch.setattr(bc, "save_figure", lambda fig, path: figures.append((fig, path)))
    report = {"quality": q}
    assert heads_report.figure_path(report, "d/x.png") == "d/x.png"
    assert heads_report.figure_path({**report, "overhead": {}}, "d/x.png") == "d/x_heads.png"
    assert heads_report.figure_path({"quality": _quality()}, "d/x.png") is None
    bench_policies_report.plot(report, "d/x.png")
    ((fig, path),) = figures
    assert path == "d/x.png"
    ppl, needle = fig.axes[0], fig.axes[1]
    labels = needle.get_legend_handles_labels()[1]
    assert labels == ["full cache", "per layer", "per head", "adaptive (AdaKV)",
                      "kvpress, per head", "kvpress AdaKVPress"]
    # keydiff's five bars, in that order: ours per layer, head, adaptive, then kvpress's
    assert [round(p.get_height(), 3) for p in needle.patches if p.get_height() > 0.55] == [
        0.6, 0.7, 0.8]
    assert max(p.get_height() for p in ppl.patches) == heads_report.PPL_TOP  # knorm, clipped


def test_table_puts_each_press_beside_its_method() -> None:
    q = _quality()
    names = [r["policy"] for r, _ in kvpress_report.interleave(q)]
    assert names == ["full", "kvpress full", "knorm", "kvpress KnormPress", "paged_eviction",
                     "keydiff", "kvpress KeyDiffPress", "kvpress KeyDiffPress, head mean"]
    ps = kvpress_report.pairs(q)
    assert [(a["policy"], b["method"], ra, rb) for a, b, ra, rb in ps] == [
        ("knorm", "knorm", 6.0, 6.0), ("keydiff", "keydiff", 1.3, pytest.approx(1.3)),
        ("keydiff", "keydiff@layer", 1.3, pytest.approx(1.3))]
    text = "\n".join(bench_policies_report._quality(q))
    # a press's PPL / full is against kvpress's own full row
    assert "| kvpress KnormPress | 25% | 66.000 | 6.000 |" in text
    assert "| knorm | 25% | KnormPress (prefill+decode) | 6.000 | 6.000 | +0.0 ✓" in text
    assert "**Ours beside kvpress**" in text
    q["kvpress"] = {"skipped": "kvpress rows skipped: no kvpress venv"}
    text = "\n".join(bench_policies_report._quality(q))
    assert "kvpress rows skipped" in text and "kvpress KnormPress" not in text


def test_figure_beside_the_main_plot(tmp_path) -> None:
    assert kvpress_report.figure_path("docs/img/x.png") == "docs/img/x_kvpress.png"
    path = str(tmp_path / "k.png")
    kvpress_report.plot({"quality": _quality()}, path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    kvpress_report.plot({"quality": {"rows": []}}, str(tmp_path / "none.png"))
    assert not os.path.exists(tmp_path / "none.png")


def _run_presses(tmp_path, methods: str) -> dict[str, dict]:
    """kvpress_compare's script in the kvpress venv over two 48-token windows of the demo
    model at a 50% budget (24 tokens): its rows by method."""
    src, dst = tmp_path / "ex.json", tmp_path / "out.json"
    windows = [[(7 * i + j) % 4000 + 5 for j in range(48)] for i in range(2)]
    src.write_text(json.dumps(kvpress_compare.exchange(
        os.path.join(REPO, "engine/demo/model"), windows, 32, [0.5], [list(range(5, 45))], 4)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([VENV, kvpress_compare.SCRIPT, "--exchange", str(src), "--out", str(dst),
                    "--methods", methods], check=True, env=env, timeout=110)
    return {r["method"]: r for r in json.loads(dst.read_text())["rows"]}


@pytest.mark.skipif(not os.access(VENV, os.X_OK), reason="no .venv-kvpress (make kvpress-venv)")
@pytest.mark.timeout(120)
def test_kvpress_script_keeps_the_cache_and_each_head_at_the_budget(tmp_path) -> None:
    """The real presses on the demo model (one run of the script: each loads kvpress,
    transformers and the model): a decoding press holds B after every step, a
    prefill-only press lets the continuation grow the cache. AdaKVPress masks instead of
    evicting: a decoding AdaKV press leaves a kv head B pairs to attend to on average
    after every step, a prefill-only one (snapkv's, and keydiff's, whose anchor would
    count the masked keys) lets it grow."""
    rows = _run_presses(tmp_path, "knorm,snapkv,knorm@layer,knorm@adakv,snapkv@adakv,"
                                  "keydiff@adakv")
    assert list(rows) == ["full", "knorm", "snapkv", "knorm@layer", "knorm@adakv",
                          "snapkv@adakv", "keydiff@adakv"]
    assert rows["knorm@layer"]["press"] == "KnormPress, head mean"
    assert rows["knorm"]["protocol"] == "prefill+decode"
    assert rows["knorm"]["max_cache_after_step"] == 24 == rows["knorm"]["budget_tokens"]
    assert rows["snapkv"]["protocol"] == "prefill" and rows["snapkv"]["max_cache_after_step"] > 24
    assert all(len(r["needle_answers"]) == 1 and len(r["needle_answers"][0]) == 4
               for r in rows.values())
    assert rows["knorm@adakv"]["press"] == "AdaKVPress(KnormPress)"
    assert rows["knorm@adakv"]["protocol"] == "prefill+decode"
    assert rows["knorm@adakv"]["max_cache_after_step"] == 24
    for m in ("snapkv@adakv", "keydiff@adakv"):  # the prompt only (kvpress_quality docstring)
        assert rows[m]["protocol"] == "prefill" and rows[m]["max_cache_after_step"] > 24


def test_score_attention_keeps_what_each_policy_keeps() -> None:
    """benchmarks/score_attention.py's kept sets: the policies' prompt plans (head mean),
    `budget` tokens each, streaming = sink + the most recent."""
    import torch

    from benchmarks.score_attention import kept_sets

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g)
    keys[:, :, 5] *= 0.01  # the smallest key norm: knorm keeps it, ‖V‖/‖K‖ too
    sets = kept_sets(keys, values, 12)
    assert all(int(m.sum(1).min()) == int(m.sum(1).max()) == 12 for m in sets.values())
    assert sets["knorm"][:, 5].all() and sets["paged_eviction"][:, 5].all()
    assert sets["streaming"][0].nonzero().flatten().tolist() == [0, 1, 2, 3, *range(32, 40)]
