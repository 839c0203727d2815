"""What the newer families need beyond logits parity (tests/test_models.py, test_parity.py):
each RoPE scaling type against transformers' own rotary embedding, longrope's factor set
following the served context, Gemma 3's multimodal checkpoint served for its text, and
what is not supported refused at load naming it."""

from __future__ import annotations

import math
import os

import httpx
import pytest
import torch
from transformers import LlamaConfig

from engine.loader import load_model
from engine.model_config import load_model_config
from engine.rope import RotaryEmbedding
from tests.live_server import tiny_server
from tests.test_models import _seqs, hf_logits, run_packed
from tests.tiny_models import make_tiny_config, make_tiny_model

POSITIONS = torch.tensor([0, 1, 7, 40, 63, 64, 200, 255, 256, 1000])


def _hf_rotated(x: torch.Tensor, positions: torch.Tensor, rotary, apply, *args) -> torch.Tensor:
    """x [T, H, D] rotated by a transformers rotary module and its apply_rotary_pos_emb."""
    cos, sin = rotary(x, positions[None], *args)
    xt = x.transpose(0, 1)[None]
    return apply(xt, xt, cos, sin)[0][0].transpose(0, 1)


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
     "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},
], ids=lambda p: p["rope_type"])
def test_llama_rope_scalings_match_transformers(params):
    """linear, yarn (with its attention scaling) and llama3, in the table and past it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=256,
                      rope_parameters=params)
    ours = RotaryEmbedding(cfg, 32, 256)
    if params["rope_type"] == "yarn":
        assert ours.attention_scaling > 1.0
    x = torch.randn(len(POSITIONS), 2, 32)
    ref = _hf_rotated(x, POSITIONS, LlamaRotaryEmbedding(cfg), apply_rotary_pos_emb)
    torch.testing.assert_close(ours.rotate(x, POSITIONS), ref)


def test_longrope_matches_transformers_for_each_factor_set():
    """Served within original_max_position_embeddings (64) kvserve rotates by the short
    factors, as transformers does for sequences up to 64; served past it, by the long
    factors, as transformers does for longer sequences. Both scale by
    sqrt(1 + ln(256 / 64) / ln 64), and only 3/4 of each head turns."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    cfg = make_tiny_config("phi3_long")
    x = torch.randn(len(POSITIONS), 2, 16)
    short, long = RotaryEmbedding(cfg, 16, 256, context=64), RotaryEmbedding(cfg, 16, 256)
    for rope in (short, long):
        assert rope.rotary_dim == 12
        assert rope.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    assert not torch.equal(short.inv_freq, long.inv_freq)
    within = POSITIONS[POSITIONS < 64]
    torch.testing.assert_close(short.rotate(x[: len(within)], within), _hf_rotated(
        x[: len(within)], within, Phi3RotaryEmbedding(cfg), apply_rotary_pos_emb))
    torch.testing.assert_close(long.rotate(x, POSITIONS), _hf_rotated(
        x, POSITIONS, Phi3RotaryEmbedding(cfg), apply_rotary_pos_emb))


def test_longrope_short_factors_when_the_context_fits(tmp_path):
    """The whole model served with max_model_len 64 (of 256) equals transformers on
    sequences up to 64; the default context (256) would not."""
    path = make_tiny_model("phi3_long", tmp_path)
    seqs = _seqs(261, lengths=(40, 29))
    ref = hf_logits(path, seqs)
    model, config = load_model(path, max_model_len=64)
    assert config.max_model_len == 64
    torch.testing.assert_close(run_packed(model, config, seqs), ref, atol=1e-4, rtol=1e-4)
    model, config = load_model(path)
    assert (run_packed(model, config, seqs) - ref).abs().max() > 1e-2


def test_engine_serves_longrope_with_the_factor_set_of_its_context(tmp_path):
    """`--max-model-len` reaches the model the engine loads: served at 64 positions (of
    256) the engine's log-probabilities are transformers' (short factors) for a greedy
    run within 64 tokens; served at the default context they are not."""
    from engine.sampling import SamplingParams
    from scheduler.llm import LLM

    path = make_tiny_model("phi3_long", tmp_path)
    prompt = _seqs(261, lengths=(30,))[0].tolist()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0,
                            detokenize=False)
    gaps = {}
    for context in (64, None):
        llm = LLM(path, num_blocks=64, block_size=16, max_model_len=context)
        out = llm.generate([prompt], params)[0]
        seq = torch.tensor(prompt + out.token_ids)
        ref = torch.log_softmax(hf_logits(path, [seq[:-1]]), dim=-1)[len(prompt) - 1:]
        want = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        gaps[context] = float((got - want).abs().max())
    assert gaps[64] < 1e-4
    assert gaps[None] > 1e-3


def test_gemma3_rope_per_layer_type_matches_transformers():
    """Sliding layers: the local base, unscaled; full layers: the global base, scaled."""
    from transformers.models.gemma3.modeling_gemma3 import (
        Gemma3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = make_tiny_config("gemma3")
    hf = Gemma3RotaryEmbedding(cfg)
    x = torch.randn(len(POSITIONS), 2, 32)
    rotated = {}
    for kind in ("sliding_attention", "full_attention"):
        ours = RotaryEmbedding(cfg, 32, 256, layer_type=kind)
        rotated[kind] = ours.rotate(x, POSITIONS)
        ref = _hf_rotated(x, POSITIONS, hf, apply_rotary_pos_emb, kind)
        torch.testing.assert_close(rotated[kind], ref)
    assert not torch.allclose(rotated["sliding_attention"], rotated["full_attention"])


def test_gemma_config_facts(tmp_path):
    c = load_model_config(make_tiny_model("gemma3", tmp_path / "g3", num_hidden_layers=3))
    assert c.family == "gemma" and c.head_dim == 32
    assert c.attn_scale == pytest.approx(24**-0.5)  # query_pre_attn_scalar, not head_dim
    assert c.sliding_windows == [24, None, 24]
    model, c2 = load_model(make_tiny_model("gemma2", tmp_path / "g2", num_hidden_layers=2))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert model.rotary_local is None  # Gemma 2: one RoPE
    assert c2.attn_softcap == 10.0 and c.attn_softcap is None  # Gemma 2 caps attention
    # Gemma 3's config may carry the field; its attention ignores it, as transformers' does
    c3 = load_model_config(make_tiny_model("gemma3", tmp_path / "g3c", num_hidden_layers=2,
                                           attn_logit_softcapping=50.0))
    assert c3.attn_softcap is None


@pytest.mark.parametrize("family,overrides,field", [
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_unsupported_gemma_features_refused_at_load(tmp_path, family, overrides, field):
    path = make_tiny_model(family, tmp_path, num_hidden_layers=2, **overrides)
    with pytest.raises(ValueError, match=field):
        load_model(path)


def test_gemma3_multimodal_checkpoint_serves_its_text(tmp_path):
    """Gemma3ForConditionalGeneration: the language model's tensors are read under either
    layout (the Hub's language_model.model.*, which save_pretrained writes, and
    transformers 5's in-memory model.language_model.*), the vision tower's are skipped,
    and the logits equal transformers' on text."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model("gemma3_mm", tmp_path, num_hidden_layers=2)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    assert any(k.startswith("vision_tower.") for k in weights)
    assert any(k.startswith("language_model.model.") for k in weights)
    seqs = _seqs(261, lengths=(30,))
    ref = hf_logits(path, seqs)
    model, config = load_model(path)
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert config.eos_token_ids[0] == 2
    torch.testing.assert_close(run_packed(model, config, seqs), ref, atol=1e-4, rtol=1e-4)

    other = {k.replace("language_model.model.", "model.language_model.", 1)
             .replace("vision_tower.", "model.vision_tower.", 1): v for k, v in weights.items()}
    save_file(other, file, metadata={"format": "pt"})
    model, config = load_model(path)
    torch.testing.assert_close(run_packed(model, config, seqs), ref, atol=1e-4, rtol=1e-4)


def test_gemma3_multimodal_server_refuses_images(tmp_path):
    """Text chat is served; an image part is a 400 naming it (the vision tower is not run)."""
    path = make_tiny_model("gemma3_mm", tmp_path, num_hidden_layers=2)
    with tiny_server(path) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        ok = c.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        bad = c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "messages.0.content.1.type"
