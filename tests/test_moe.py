"""The sparse mixture-of-experts block (engine/models/moe.py) against transformers' own
blocks: the same experts chosen and the same output for a step of many tokens, for
Qwen3-MoE (renormalised or not), Mixtral and gpt-oss (router bias, top-k then softmax,
expert biases, clamped interleaved SwiGLU, [E, in, out] weights). Whole models through
the engine: tests/test_models.py (logits) and tests/test_parity.py (greedy generation).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import transformers
from tiny_models import make_tiny_model

from engine.loader import load_model
from engine.models.moe import SparseMoe, moe_spec

_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
CASES = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                       norm_topk_prob=True)),
    "qwen3_moe_unnormed": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock",
                           dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                                norm_topk_prob=False)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", "MixtralSparseMoeBlock",
                dict(num_local_experts=5, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", "GptOssMLP",
                # a low limit, so the clamps bite (7.0 in the released models)
                dict(num_local_experts=6, num_experts_per_tok=3, head_dim=16, swiglu_limit=1.5)),
}


def _blocks(case: str, dtype: torch.dtype) -> tuple[torch.nn.Module, SparseMoe]:
    """transformers' block with wide random weights and ours holding the same tensors."""
    arch, config_cls, block_cls, kwargs = CASES[case]
    hf_config = getattr(transformers, config_cls)(**_SHAPE, **kwargs)
    kind = hf_config.model_type
    modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    block = getattr(modeling, block_cls)(hf_config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() < 3 else 0.15))
    spec = moe_spec(arch, hf_config)
    assert spec is not None
    ours = SparseMoe(spec)
    ours.load_state_dict(block.state_dict())  # the same names and shapes
    return block.to(dtype).eval(), ours.to(dtype).eval()


def _hf(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, H], chosen experts [T, k]) of transformers' block."""
    router = block.router if hasattr(block, "router") else block.gate
    ids = router(x)[2]
    out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0], ids


@pytest.mark.parametrize("tokens", [1, 3, 300])
@pytest.mark.parametrize("case", list(CASES))
def test_block_matches_transformers(case, tokens):
    """A step of `tokens` rows (300: every expert busy, some much more than others; 1 and
    3: most experts empty) routes and sums as transformers' block does."""
    block, ours = _blocks(case, torch.float32)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref, ref_ids = _hf(block, x)
        weights, ids = getattr(ours, ours.spec.router)(x)
        out = ours(x)
    assert torch.equal(ids, ref_ids)
    sums = weights.sum(-1)
    if ours.spec.renormalize or ours.spec.topk_of_logits:  # softmax over the k: sums 1 too
        torch.testing.assert_close(sums, torch.ones(tokens))
    else:
        assert (sums < 1 - 1e-4).all()
    assert ref.abs().max() > 0.5  # the experts' outputs are large enough to tell apart
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    if tokens == 300:
        assert ids.unique().numel() == ours.spec.num_experts


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_block_bf16_near_transformers(case):
    block, ours = _blocks(case, torch.bfloat16)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        ref, _ = _hf(block, x)
        out = ours(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 2e-2


def test_dense_and_sparse_layers_of_qwen3_moe(tmp_path):
    """mlp_only_layers and decoder_sparse_step pick the dense layers as transformers does;
    a dense layer keeps the Llama MLP of intermediate_size."""
    path = make_tiny_model("qwen3_moe", tmp_path, num_hidden_layers=4, mlp_only_layers=[2],
                           decoder_sparse_step=2)
    model, _ = load_model(path)
    # layer i sparse iff (i + 1) % 2 == 0 and i not in [2]: only layer 1 and 3
    assert [isinstance(layer.mlp, SparseMoe) for layer in model.model.layers] == [
        False, True, False, True]
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (8, 2 * 48, 64)


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_model("mixtral", tmp_path, num_hidden_layers=1)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    del weights["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(weights, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing model\.layers\.0\.block_sparse_moe\.experts"
                                         r"\.3\.w2\.weight"):
        load_model(path)


# family -> (transformers' dtypes, tolerance). The tiny gpt-oss in transformers' own bf16
# departs from its fp32 by up to 0.29 on the 40-token prompt, and the engine's bf16 follows
# one or the other by the CPU's bf16 kernels (AVX-512 BF16 builds: within 0.03 of fp32 and
# 0.06-0.26 from bf16), so there a token must be near either reference
BF16_REFS = {"qwen3_moe": ((torch.float32,), 0.1), "mixtral": ((torch.float32,), 0.1),
             "gpt_oss": ((torch.float32, torch.bfloat16), 0.05)}


@pytest.mark.parametrize("family", list(BF16_REFS))
def test_bf16_engine_near_transformers(family, tmp_path):
    """In bf16 through the engine (the CPU's chosen linear layouts, the paged KV cache),
    the first token's top log-probabilities stay near transformers' (fp32, or either of
    fp32 and bf16 where those two differ by more than the tolerance, `BF16_REFS`)."""
    from transformers import AutoModelForCausalLM

    from engine.sampling import SamplingParams
    from scheduler.llm import LLM

    path = make_tiny_model(family, tmp_path)
    prompts = [torch.randint(5, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (7, 40)]
    llm = LLM(path, dtype="bfloat16", num_blocks=64, block_size=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                logprobs=5, detokenize=False))
    dtypes, tolerance = BF16_REFS[family]
    hfs = [AutoModelForCausalLM.from_pretrained(path, dtype=d).eval() for d in dtypes]
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 4
        with torch.inference_mode():
            refs = [torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
                    for hf in hfs]
        for token, logprob in out.logprobs[0].top:
            assert min(abs(logprob - ref[token].item()) for ref in refs) < tolerance, \
                (family, token)
