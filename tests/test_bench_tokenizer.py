"""The word tokenizer of the random-weight benchmark models (`loadtest/random_models.py`).

A random-weight model samples ids from its whole vocabulary; the serving benchmark takes
TTFT at the first streamed chunk with text, so every such id must decode to text on its
own, and prompts made of text must still come out at the asked token length.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from transformers import AutoTokenizer

from loadtest.random_models import (
    FIRST_TOKEN_ID,
    MODEL_CONFIGS,
    build_model,
    make_word_tokenizer,
)
from loadtest.workloads import TextMaker
from scheduler.detokenizer import Detokenizer
from tests.tiny_models import make_tokenizer

VOCAB_160M = int(MODEL_CONFIGS["160m"]["vocab_size"])


@pytest.fixture(scope="module")
def tok160():
    return make_word_tokenizer(VOCAB_160M)


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_every_id_decodes_alone_to_one_printable_word(name: str) -> None:
    vocab = int(MODEL_CONFIGS[name]["vocab_size"])
    tok = make_word_tokenizer(vocab)
    assert len(tok) == vocab
    assert sorted(tok.all_special_ids) == list(range(FIRST_TOKEN_ID))
    texts = [tok.decode([i]) for i in range(FIRST_TOKEN_ID, vocab)]
    bad = [t for t in texts if not t or not t.isprintable() or t != t.strip()]
    assert not bad
    assert len(set(texts)) == len(texts)


def test_build_model_saves_a_tokenizer_autotokenizer_loads(tmp_path) -> None:
    path = str(tmp_path / "tiny")
    build_model("tiny", path)
    tok = AutoTokenizer.from_pretrained(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert len(tok) == cfg["vocab_size"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"])
    assert tok.unk_token_id < FIRST_TOKEN_ID
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_encode_decode_round_trips_random_ids(tok160) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(FIRST_TOKEN_ID, VOCAB_160M) for _ in range(2000)]
    assert tok160.encode(tok160.decode(ids), add_special_tokens=False) == ids


def test_detokenizer_streams_text_for_every_token(tok160) -> None:
    rng = random.Random(1)
    ids = [rng.randrange(FIRST_TOKEN_ID, VOCAB_160M) for _ in range(300)]
    d = Detokenizer(tok160, [])
    deltas = [d.add([t])[0] for t in ids]
    assert all(deltas)
    assert all(x.startswith(" ") for x in deltas[1:])
    assert "".join(deltas) + d.flush() == tok160.decode(ids)


def test_text_maker_prompts_have_the_asked_length_without_unk(tok160) -> None:
    maker = TextMaker(0, tok160)
    rng = random.Random(2)
    for n in (1, 7, 100, 384, 1000):
        ids = tok160.encode(maker.text(n, rng), add_special_tokens=False)
        assert len(ids) == n
        assert tok160.unk_token_id not in ids


def test_prepare_model_replaces_an_older_byte_tokenizer(tmp_path) -> None:
    from loadtest.bench_serving import prepare_model

    model = prepare_model("tiny", str(tmp_path))
    make_tokenizer().save_pretrained(model["path"])  # as a model built before the change
    again = prepare_model("tiny", str(tmp_path))
    assert len(AutoTokenizer.from_pretrained(again["path"])) == model["vocab_size"]


def test_gpu_benchmark_shape_is_llama_3_2_1b() -> None:
    """`--model 1b` (benchmarks/bench_gpu.py): Llama-3.2-1B's shape, GQA 4:1, 1.24B
    parameters with tied embeddings (counted on the meta device: nothing allocated)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL_CONFIGS["1b"])
    assert config.num_attention_heads // config.num_key_value_heads == 4
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 1.24
