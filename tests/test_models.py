"""Engine models vs transformers: same logits for every supported family.

The attention callback here is a plain dense causal softmax over packed sequences
(segment mask + sliding window + GQA), i.e. what the runner's paged attention must equal.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import TINY_FAMILIES, make_tiny_model
from transformers import AutoModelForCausalLM

from engine.loader import load_model
from engine.model_config import SUPPORTED_ARCHITECTURES, load_model_config
from engine.rope import RotaryEmbedding
from native.build import load_ops

CASES = {f: (f, {}) for f in TINY_FAMILIES} | {
    "gpt_neox_serial": ("gpt_neox", {"use_parallel_residual": False, "rotary_pct": 0.25}),
    # Every second layer sparse, 3 of 8 experts a token, not renormalised.
    "qwen3_moe_step": ("qwen3_moe", {"mlp_only_layers": [], "decoder_sparse_step": 2,
                                     "num_experts_per_tok": 3, "norm_topk_prob": False}),
    # Phi-4-mini's shape: partial rotary and longrope with tied embeddings, no window
    "phi4_mini": ("phi3", {"tie_word_embeddings": True, "sliding_window": None}),
    # gpt-oss tied, 4 experts 3 a token, the window (8) shorter than both sequences
    "gpt_oss_tied": ("gpt_oss", {"tie_word_embeddings": True, "num_local_experts": 4,
                                 "num_experts_per_tok": 3, "sliding_window": 8}),
}
# phi3_long is served past its original 64 positions (long factors): transformers agrees
# on sequences longer than that
LENGTHS = {"phi3_long": (80, 70)}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Checkpoints are built lazily, once per module."""
    cache: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in cache:
            family, overrides = CASES[case]
            cache[case] = make_tiny_model(family, tmp_path_factory.mktemp(case), **overrides)
        return cache[case]

    return get


def dense_attention(seq_ids: torch.Tensor, positions: torch.Tensor, windows: list[int | None],
                    scale: float | None = None, softcap: float | None = None, sinks=None):
    """attn(layer, q, k, v) for packed tokens: causal within a sequence, windowed per layer;
    softmax scale `scale` (default head_dim ** -0.5), scores soft-capped at `softcap`
    (Gemma 2), `sinks(layer)`: the layer's learned sink logits [H] or None (gpt-oss),
    an extra softmax column with no value."""
    same = seq_ids[:, None] == seq_ids[None, :]
    delta = positions[:, None] - positions[None, :]  # query pos - key pos

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = same & (delta >= 0)
        if windows[layer] is not None:
            mask &= delta < windows[layer]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * (scale or q.shape[-1] ** -0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks(layer) if sinks is not None else None
        if sink is not None:
            col = sink.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, col], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)

    return attn


def run_packed(model, config, seqs: list[torch.Tensor]) -> torch.Tensor:
    """All-position logits of several sequences packed along T."""
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    seq_ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    attn = dense_attention(seq_ids, positions, config.sliding_windows, config.attn_scale,
                           config.attn_softcap, getattr(model, "attention_sinks", None))
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, attn))


def hf_logits(path: str, seqs: list[torch.Tensor], dtype=torch.float32) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    with torch.inference_mode():
        return torch.cat([hf(s[None]).logits[0].float() for s in seqs])


def _seqs(vocab: int, lengths=(40,), seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_parity_with_transformers(case, tiny_dirs):
    path = tiny_dirs(case)
    model, config = load_model(path)
    # 40 > sliding window 24, so windowed layers really drop keys.
    n, m = LENGTHS.get(case, (40, 29))
    seqs = _seqs(config.vocab_size, lengths=(n, m))
    ref = hf_logits(path, seqs)
    assert ref.abs().max() > 1.0  # weights are wide enough that a bug would show

    single = run_packed(model, config, seqs[:1])
    assert single.dtype == torch.float32 and single.shape == (n, config.vocab_size)
    torch.testing.assert_close(single[-1], ref[n - 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(single, ref[:n], atol=1e-4, rtol=1e-4)

    packed = run_packed(model, config, seqs)
    torch.testing.assert_close(packed, ref, atol=1e-4, rtol=1e-4)


def lay_out_in_pairs(model: torch.nn.Module) -> int:
    """Every `nn.Linear` of a bf16 model replaced by bf16 pair panels (any CPU: bf16 dot
    products where it has them, the same sums in a loop elsewhere); how many."""
    from engine.cpu_linear import PanelLinear

    done = 0
    for name, linear in [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, PanelLinear(linear, pairs=True))
        done += 1
    return done


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("case", ["llama3", "qwen2", "gpt_neox", "olmo2", "gemma3"])
def test_bf16_smoke(case, pairs, tiny_dirs):
    """bf16 logits near transformers' bf16 and fp32 ones, dense or with every linear layer
    in bf16 pair panels (engine/csrc/linear_panels.h's bf16 dot products)."""
    path = tiny_dirs(case)
    model, config = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    if pairs:
        if not load_ops("kvserve_layer_ops_cpu"):
            pytest.skip("no C++ compiler: no panels")
        assert lay_out_in_pairs(model) >= 4 * config.num_layers
    seqs = _seqs(config.vocab_size, lengths=(33,))
    ours = run_packed(model, config, seqs)
    assert ours.dtype == torch.float32
    ref = hf_logits(path, seqs, dtype=torch.bfloat16)
    assert (ours - ref).norm() / ref.norm() < 3e-2
    fp32 = hf_logits(path, seqs)
    assert (ours - fp32).norm() / fp32.norm() < 5e-2


def test_checkpoint_dtype_is_default(tmp_path):
    path = make_tiny_model("qwen3", tmp_path, dtype=torch.bfloat16, num_hidden_layers=1)
    model, config = load_model(path)
    assert config.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_sliding_windows_match_layer_types(tiny_dirs):
    for case, expected in [
        ("qwen2", [None, 24, 24]),
        ("mistral", [24, 24, 24]),
        ("llama", [None, None, None]),
        ("qwen3", [None, None, None]),
        ("phi3", [24, 24, 24]),
        ("gemma2", [24, None, 24]),
        ("gemma3", [24, None, 24]),
    ]:
        config = load_model_config(tiny_dirs(case))
        assert config.sliding_windows == expected, case
        hf = config.hf_config
        if hasattr(hf, "layer_types") and case.startswith(("qwen", "gemma")):
            assert [w is not None for w in config.sliding_windows] == [
                t == "sliding_attention" for t in hf.layer_types
            ]


def test_config_fields(tiny_dirs):
    c = load_model_config(tiny_dirs("llama3"))
    assert (c.family, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama",
        3,
        4,
        2,
        32,
    )
    assert c.eos_token_ids == [2, 4]  # config.json eos + generation_config.json list
    n = load_model_config(tiny_dirs("gpt_neox"))
    assert (n.family, n.num_kv_heads, n.head_dim) == ("gpt_neox", 4, 16)


def test_tied_embeddings(tiny_dirs):
    path = tiny_dirs("llama_tied")
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is True
    model, _ = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unknown_architecture_error(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    )
    with pytest.raises(ValueError, match="FalconForCausalLM") as err:
        load_model_config(str(tmp_path))
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)


def test_missing_and_unexpected_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_model("llama", tmp_path, num_hidden_layers=1)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    del weights["model.layers.0.mlp.up_proj.weight"]
    weights["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(weights, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing model.layers.0.mlp.up_proj.weight, "
                       r"unexpected model.layers.0.extra.weight"):
        load_model(path)


def test_llama_holds_qkv_and_gate_up_stacked(tmp_path):
    """q/k/v and gate/up are read from their checkpoint tensors into one GEMM each (the
    parity tests above check the outputs); a part of the wrong shape is named."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model("qwen2", tmp_path, num_hidden_layers=2)  # biased q/k/v
    model, config = load_model(path)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * config.num_layers + 1
    attn = model.model.layers[1].self_attn
    hf = load_file(os.path.join(path, "model.safetensors"))
    torch.testing.assert_close(attn.qkv_proj.bias, torch.cat(
        [hf[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]))
    weights = dict(hf)
    weights["model.layers.0.mlp.up_proj.weight"] = weights[
        "model.layers.0.mlp.up_proj.weight"][:, :-1].contiguous()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"gate_up_proj.weight: its parts .*gate_proj"):
        load_model(path)


def test_sharded_checkpoint(tmp_path):
    path = make_tiny_model("qwen2", tmp_path / "one", num_hidden_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(path)
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    a, config = load_model(path)
    b, _ = load_model(sharded)
    seqs = _seqs(config.vocab_size, lengths=(12,))
    torch.testing.assert_close(run_packed(a, config, seqs), run_packed(b, config, seqs))


def test_rope_beyond_table_matches_transformers(tiny_dirs):
    """Positions past max_position_embeddings (and negative deltas) are computed on the fly."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = load_model_config(tiny_dirs("llama3"))
    rope = RotaryEmbedding(config.hf_config, config.head_dim, max_positions=256)
    ref_rope = LlamaRotaryEmbedding(config.hf_config)
    positions = torch.tensor([0, 7, 255, 256, 1000, 70000])
    x = torch.randn(len(positions), 2, config.head_dim)
    cos, sin = ref_rope(x, positions[None])
    ref, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(rope.rotate(x, positions), ref[0].transpose(0, 1))
    # A caller that knows the largest position (the runner: no device sync) gets the
    # same bits, in the table and past it.
    for pos in (positions[:3], positions):
        want = rope.cos_sin(pos)
        got = rope.cos_sin(pos, max_position=int(pos.max()))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # Re-rotation by a delta composes: R(p) then R(d) == R(p + d), also for d < 0.
    p, d = torch.tensor([10, 300, 50]), torch.tensor([-5, 7, -50])
    y = torch.randn(3, 2, config.head_dim, dtype=torch.float64).float()
    torch.testing.assert_close(
        rope.rotate(rope.rotate(y, p), d, scaled=False), rope.rotate(y, p + d), atol=1e-4, rtol=1e-4
    )


def test_dynamic_rope_rejected(tmp_path):
    path = make_tiny_model(
        "llama",
        tmp_path,
        num_hidden_layers=1,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    with pytest.raises(ValueError, match="dynamic"):
        load_model(path)


def test_positions_beyond_max_are_relative(tiny_dirs):
    """RoPE is relative: shifting every position (past max_position_embeddings, so the
    cos/sin come from the on-the-fly path) leaves the logits unchanged."""
    model, config = load_model(tiny_dirs("qwen3"))
    ids = _seqs(config.vocab_size, lengths=(20,))[0]
    attn = dense_attention(torch.zeros(20), torch.arange(20), config.sliding_windows)
    with torch.inference_mode():
        base = model.compute_logits(model(ids, torch.arange(20), attn))
        shifted = model.compute_logits(model(ids, torch.arange(20) + 1000, attn))
    torch.testing.assert_close(shifted, base, atol=2e-3, rtol=1e-3)


def test_gpt_neox_legacy_tensor_names(tiny_dirs, tmp_path):
    """Old Pythia files carry rotary/mask buffers; transformers 5 may name the head lm_head."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_dirs("gpt_neox"), tmp_path / "neox")
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    weights["lm_head.weight"] = weights.pop("embed_out.weight")
    weights["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(4)
    weights["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    weights["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    save_file(weights, file, metadata={"format": "pt"})
    model, _ = load_model(str(path))
    torch.testing.assert_close(model.embed_out.weight, weights["lm_head.weight"])


def test_tiny_tokenizer_roundtrip(tiny_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs("llama"))
    config = load_model_config(tiny_dirs("llama"))
    assert len(tok) == config.vocab_size and tok.eos_token_id in config.eos_token_ids
    text = "héllo, wörld 🙂"
    assert tok.decode(tok(text)["input_ids"]) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt.startswith("<|im_start|>user\nhi<|im_end|>")
