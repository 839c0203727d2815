"""Model runner: attention statistics for the requests that ask, sliding-window freeing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.runner import SeqInput
from engine.sampling import SamplingParams
from kvpool.seq_cache import SeqCache
from scheduler.llm import LLM
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_attention_mass_matches_transformers_eager(llama):
    """Per-slot attention mass (summed over each kv group's query heads) equals the
    attention weights transformers reports, for a chunk that attends to a cached prefix;
    a request that does not ask gets nothing and the same hidden states."""
    llm = LLM(llama, num_blocks=64, block_size=4)
    eng = llm.engine
    cfg = eng.model_config
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, cfg.vocab_size, (19,), generator=g).tolist()
    cache = SeqCache(eng.pool, cfg.num_layers)
    other = SeqCache(eng.pool, cfg.num_layers)
    first = SeqInput(prompt[:7], 0, cache.append(torch.arange(7)), cache, False)
    eng.runner.execute([first])  # the prefix, without statistics
    rest = SeqInput(prompt[7:], 7, cache.append(torch.arange(7, 19)), cache, True, True)
    bystander = SeqInput(prompt[:5], 0, other.append(torch.arange(5)), other, True)
    out = eng.runner.execute([rest, bystander])
    assert set(out.attention) == {0}
    mass = out.attention[0]
    assert len(mass) == cfg.num_layers

    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_attentions=True)
    g_size = cfg.num_heads // cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        a = ref.attentions[layer][0]  # [Hq, T, T]
        want = a.view(cfg.num_kv_heads, g_size, 19, 19).sum(1).permute(1, 0, 2)[7:]
        got = mass[layer][:, :, :19]
        assert torch.allclose(got, want, atol=1e-5), layer
        assert torch.allclose(got.sum(-1), torch.full((12, cfg.num_kv_heads), float(g_size)), atol=1e-4)
    assert torch.allclose(out.logits[0], ref.logits[0, -1], atol=1e-4)


def test_sliding_window_frees_blocks_outside_every_window(tmp_path):
    path = make_tiny_model("mistral", tmp_path)  # window 24 on every layer
    llm = LLM(path, num_blocks=256, block_size=4)
    out = llm.generate([[7] * 10], SamplingParams(max_tokens=150, temperature=0, ignore_eos=True,
                                                  detokenize=False))[0]
    layers = llm.engine.model_config.num_layers
    # 24 visible tokens need at most 7 blocks of 4 per layer (+1 being filled), not 40.
    assert out.kv.peak_blocks <= layers * 8
    assert llm.engine.pool.num_used == 0
