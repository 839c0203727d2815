"""The committed demo model (engine/demo/model) and the code that builds and evaluates it
(demo_model/: corpus, tokenizer, training, evaluation harness).

Fast by design (no training): load with transformers and with kvserve's loader, compare logits,
round-trip the tokenizer, and smoke-test the data / tokenizer / evaluation helpers on tiny input.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from demo_model.data import RecallGenerator, is_heldout, source_files
from demo_model.evaluate import EvalData, heldout_lm, needle
from demo_model.tokenizer import CHAT_TEMPLATE, EOS, save_hf_tokenizer, train_tokenizer
from engine.demo import DEMO_MODEL_DIR

MODEL_DIR = Path(os.environ.get("KVSERVE_DEMO_MODEL_DIR", DEMO_MODEL_DIR))
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json")
TEXT = 'The "for" statement is used to iterate over the elements of a sequence.\n' \
       "    def f(x):\n        return x + 48213  # héllo ✓\n"


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def test_committed_files_and_size():
    for name in REQUIRED:
        assert (MODEL_DIR / name).is_file(), name
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= 30 * 2**20, f"model dir is {total / 2**20:.1f} MiB (> 30 MiB)"
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert cfg["max_position_embeddings"] >= 1024
    tcfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == CHAT_TEMPLATE


def test_transformers_loads_and_predicts(hf_model, hf_tokenizer):
    ids = hf_tokenizer("The pass key is 48213. Remember it.", return_tensors="pt").input_ids
    assert ids[0, 0].item() == hf_tokenizer.bos_token_id
    with torch.inference_mode():
        logits = hf_model(ids).logits
    assert logits.shape == (1, ids.shape[1], hf_model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # A trained model, not random weights: it must predict its own text far better than uniform.
    logp = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None])
    assert -logp.mean().item() < 0.6 * np.log(hf_model.config.vocab_size)


def test_tokenizer_round_trip_and_chat_template(hf_tokenizer):
    from tokenizers import Tokenizer

    ids = hf_tokenizer(TEXT).input_ids
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    assert raw.encode(TEXT).ids == ids
    assert raw.decode(ids) == TEXT
    digits = hf_tokenizer.convert_ids_to_tokens(hf_tokenizer("48213").input_ids[1:])
    assert digits == list("48213")  # one token per digit: pass keys are copied digit by digit
    chat = hf_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                            add_generation_prompt=True)
    assert chat == "<|user|>\nhi\n<|assistant|>\n"


def test_kvserve_loader_matches_transformers(hf_model, hf_tokenizer):
    if importlib.util.find_spec("engine.loader") is None:
        pytest.skip("engine.loader (kvserve's checkpoint loader) is not in this tree yet")
    from engine.loader import load_model

    model, _config = load_model(str(MODEL_DIR), dtype=torch.float32)
    ids = hf_tokenizer("The import system " * 8, return_tensors="pt").input_ids[0]
    positions = torch.arange(len(ids))

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)

    with torch.inference_mode():
        ours = model.compute_logits(model(ids, positions, attn))
        ref = hf_model(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_stdlib_corpus_selection_is_deterministic():
    files = source_files()
    assert len(files) > 100
    assert files == source_files()
    assert not any("test" in p.parts[-2:-1] for p in files)
    assert is_heldout("json/decoder.py") == is_heldout("json/decoder.py")
    held = sum(is_heldout(f"doc{i}") for i in range(2000)) / 2000
    assert 0.01 < held < 0.1


def _tiny_tokenizer():
    texts = [TEXT, "The pass key is 12345. Remember it. What is the pass key?"] * 20
    return train_tokenizer(texts, vocab_size=300)


def test_tokenizer_training_and_hf_export(tmp_path):
    from transformers import AutoTokenizer

    tok = _tiny_tokenizer()
    save_hf_tokenizer(tok, tmp_path, 1024)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.eos_token == hf.bos_token == EOS
    assert hf.decode(hf(TEXT).input_ids, skip_special_tokens=True) == TEXT


def test_recall_documents_exact_length_and_answer():
    tok = _tiny_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    gen = RecallGenerator(enc, 0, np.arange(5, 200, dtype=np.int32))
    rng = np.random.default_rng(0)
    for depth in (0.0, 0.5, 1.0):
        for filler in ("repeat", "text"):
            s = gen.passkey(rng, 200, depth, filler)
            assert len(s.ids) == 200 and s.ids[0] == 0
            assert tok.decode(s.ids[s.prompt_len:]).strip() == f"{s.answer}."
            assert s.answer in tok.decode(s.ids[:s.prompt_len])
    f = gen.facts(rng, 300, 4)
    assert len(f.ids) == 300 and f.answer in tok.decode(f.ids[:f.prompt_len])
    c = gen.copy(rng, 120)
    body = c.ids[c.prompt_len:]
    assert len(c.ids) == 120 and tok.decode(c.ids[:c.prompt_len]).endswith(tok.decode(body) + " Again:")


class _OracleBackend:
    """Uniform scorer; a generator that 'reads' the key from the prompt: checks the plumbing."""

    max_context = 64

    def __init__(self, tok, vocab: int) -> None:
        self.tok, self.vocab = tok, vocab

    def score(self, ids):
        assert len(ids) <= self.max_context
        return [-float(np.log(self.vocab))] * (len(ids) - 1)

    def generate(self, prompt_ids, max_new_tokens):
        text = self.tok.decode(list(prompt_ids))
        key = text.split("The pass key is")[1].split(".")[0]
        return self.tok.encode(f" {key}.", add_special_tokens=False).ids[:max_new_tokens]


def test_evaluation_harness_plumbing():
    from collections import Counter

    tok = _tiny_tokenizer()
    vocab = tok.get_vocab_size()
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    text = TEXT * 3
    ids = enc(text)
    data = EvalData(tok, [("code", text, ids)], Counter(ids), Counter(text.encode()), 0,
                    RecallGenerator(enc, 0, np.array(ids, dtype=np.int32)))
    lm = heldout_lm(_OracleBackend(tok, vocab), data, progress=False)["all"]
    assert lm["tokens"] == len(ids)
    assert lm["bits_per_byte"] == pytest.approx(np.log2(vocab) * len(ids) / len(text.encode()))
    assert lm["unigram_bits_per_byte"] < lm["bits_per_byte"]
    res = needle(_OracleBackend(tok, vocab), data, trials=2, lengths=(64,), depths=(0.0, 1.0),
                 tasks=("passkey/repeat",), progress=False)
    assert res == {"passkey/repeat": {"64": {"0.00": 1.0, "1.00": 1.0}}}
