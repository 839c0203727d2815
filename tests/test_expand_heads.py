"""demo_model/expand_heads.py: more kv heads, same function; and the committed 4-kv-head variant.

The expansion is checked against the unexpanded model with HF transformers in fp32: copying
kv head j to the heads its query heads map to must leave the logits unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch

from demo_model.expand_heads import expand_kv_heads, main
from engine.demo import DEMO_MODEL_DIR

KV4_DIR = DEMO_MODEL_DIR.parent / "model_kv4"


def _load(path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 4096, (2, 96), generator=g)


@pytest.fixture(scope="module")
def base_logits() -> torch.Tensor:
    with torch.inference_mode():
        return _load(DEMO_MODEL_DIR)(input_ids=_ids()).logits


@pytest.mark.parametrize("kv_heads", [4, 8])
def test_expanded_model_computes_the_same_logits(base_logits, kv_heads):
    model = _load(DEMO_MODEL_DIR)
    expand_kv_heads(model, kv_heads)
    assert model.config.num_key_value_heads == kv_heads
    k = model.model.layers[0].self_attn.k_proj.weight
    assert k.shape == (kv_heads * 32, 256)
    with torch.inference_mode():
        logits = model(input_ids=_ids()).logits
    torch.testing.assert_close(logits, base_logits, atol=1e-5, rtol=1e-5)
    # the cached path (what generate and kvserve's decode use) sees the same keys too
    with torch.inference_mode():
        out = model(input_ids=_ids()[:, :95], use_cache=True)
        step = model(input_ids=_ids()[:, 95:], past_key_values=out.past_key_values).logits
    assert out.past_key_values.layers[0].keys.shape[1] == kv_heads
    torch.testing.assert_close(step[:, -1], base_logits[:, -1], atol=1e-5, rtol=1e-5)


def test_expansion_rejects_counts_that_do_not_split_the_groups():
    model = _load(DEMO_MODEL_DIR)
    for bad in (1, 3, 16):
        with pytest.raises(ValueError, match="multiple of the model's 2 kv heads"):
            expand_kv_heads(model, bad)
    assert model.config.num_key_value_heads == 2


def test_cli_writes_a_loadable_expanded_checkpoint(tmp_path, base_logits):
    main([str(DEMO_MODEL_DIR), str(tmp_path), "--kv-heads", "4"])
    assert json.loads((tmp_path / "config.json").read_text())["num_key_value_heads"] == 4
    assert (tmp_path / "tokenizer.json").read_text() == (DEMO_MODEL_DIR / "tokenizer.json").read_text()
    with torch.inference_mode():
        logits = _load(tmp_path)(input_ids=_ids()).logits
    torch.testing.assert_close(logits, base_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not (KV4_DIR / "model.safetensors").is_file(), reason="no model_kv4 yet")
def test_committed_kv4_variant_has_diverged_heads():
    """The uptrained variant: 4 kv heads whose duplicated pairs have become different heads."""
    model = _load(KV4_DIR)
    assert model.config.num_key_value_heads == 4
    for layer in model.model.layers:
        k = layer.self_attn.k_proj.weight.view(4, 32, 256)
        for j in (0, 2):  # heads j and j+1 started as copies of one head of the demo model
            rel = (k[j] - k[j + 1]).norm() / k[j].norm()
            assert rel > 0.05, float(rel)  # 0.16-0.24 committed; unrelated heads ~1.3
    assert (KV4_DIR / "tokenizer.json").read_text() == (DEMO_MODEL_DIR / "tokenizer.json").read_text()
