"""The random-weight models the benchmarks build (Llama unless a config says), and their tokenizer.

`MODEL_CONFIGS` are the shapes the issues measure (3m, 160m, 1b, and tiny for --quick;
moe and gemma3 for the newer families, tiny_moe and tiny_gemma3 for their --quick);
`build_model` saves one with random weights and a tokenizer in which every id decodes to
one printable word, so a streaming server sends text for any sampled id. The serving
benchmark (`loadtest/bench_serving.py`) builds them as the engine benchmarks
(`benchmarks/`) do; the test models (tests/tiny_models.py) share the specials and the
chat template.
"""

from __future__ import annotations

import itertools
import string
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Llama configs of the issues. 3m: ~3.8M parameters with tied embeddings. 160m: the
# shape of JackFram/llama-160m (MHA, untied head). tiny: only for --quick.
MODEL_CONFIGS: dict[str, dict[str, object]] = {
    "3m": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=2, intermediate_size=688, vocab_size=4096,
               tie_word_embeddings=True),
    "160m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, intermediate_size=3072, vocab_size=32000,
                 tie_word_embeddings=False),
    # The shape of Llama-3.2-1B (GQA 4:1, tied embeddings), for the GPU benchmark.
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
               tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                 tie_word_embeddings=True),
    # Issue 66's newer families, near 3m's size: a Qwen3-MoE (16 experts, 2 a token, every
    # layer sparse, QK-norm) and a Gemma 3 text model (5 sliding layers of window 128 to
    # each full one, QK-norm, its own RoPE base for the sliding layers, scaled embeddings).
    # `model_type` names the transformers config; without one a config is Llama's.
    "moe": dict(model_type="qwen3_moe", hidden_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
                intermediate_size=1024, norm_topk_prob=True, vocab_size=8192,
                tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", hidden_size=512, num_hidden_layers=6,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                   intermediate_size=2048, query_pre_attn_scalar=64, sliding_window=128,
                   sliding_window_pattern=6, vocab_size=8192, tie_word_embeddings=True),
    "tiny_moe": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "tiny_gemma3": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, query_pre_attn_scalar=16, sliding_window=8,
                        sliding_window_pattern=2, vocab_size=512, tie_word_embeddings=True),
}
# Specials shared by the benchmark tokenizer and the test models' (tests/tiny_models.py):
# the configs' pad/bos/eos are ids 0/1/2, and the chat template is ChatML.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Ids 0-4 are those specials, 5 is <unk>; every id from FIRST_TOKEN_ID up is one printable
# word. Prompts of random ids avoid the specials.
FIRST_TOKEN_ID = 6
UNK_TOKEN = "<unk>"
# The WordPiece decoder joins a token to the previous one without a space only if it starts
# with this prefix; no vocabulary word does, so decoded ids are always space-separated.
_NO_JOIN_PREFIX = "##"
_GLYPHS = [chr(c) for c in range(33, 127)]  # printable ASCII, space excluded


def build_model(name: str, path: str, seed: int = 0, max_positions: int = 2048) -> int:
    """Save a random-weight model of config `name` (a LlamaForCausalLM unless it names a
    `model_type`) and a word tokenizer to `path`; returns #params.

    transformers' own init (std 0.02) is fine here: only speed and memory are measured,
    and greedy decoding of any weights exercises exactly the same kernels.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(MODEL_CONFIGS[name])
    config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields,
                                  max_position_embeddings=max_positions,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(name, path)
    return sum(p.numel() for p in model.parameters())  # tied weights count once


def save_tokenizer(name: str, path: str) -> None:
    """Write the word tokenizer of model config `name` into `path` (also over an older one:
    a model built before this tokenizer existed keeps its weights and gets it)."""
    make_word_tokenizer(int(MODEL_CONFIGS[name]["vocab_size"])).save_pretrained(path)


def vocab_words(n: int) -> list[str]:
    """`n` distinct printable words without whitespace: the 94 printable ASCII characters
    (so any ASCII word can be spelt), then lowercase strings, shortest first."""
    strings = ("".join(t) for k in itertools.count(2)
               for t in itertools.product(string.ascii_lowercase, repeat=k))
    return list(itertools.islice(itertools.chain(_GLYPHS, strings), n))


def make_word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer of exactly `vocab_size` ids in which each id >= FIRST_TOKEN_ID is one word.

    Why: a random-weight model samples ids from its whole vocabulary, and with a byte
    tokenizer most of them are not valid UTF-8 on their own, so a streaming server sends
    empty chunks and a client sees no first token. Here every id decodes to non-empty
    printable text, decoded ids are joined by single spaces (each generated token streams
    as " word") and encode(decode(ids)) == ids. Text is split on whitespace; a word that is
    not in the vocabulary is spelt greedily with the longest vocabulary words (WordPiece
    with an empty continuation prefix), each whitespace-separated word on its own, so
    `TextMaker`'s per-word token counts add up exactly. Only non-ASCII words become <unk>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [*SPECIAL_TOKENS, UNK_TOKEN]
    assert len(specials) == FIRST_TOKEN_ID
    if vocab_size < FIRST_TOKEN_ID + len(_GLYPHS):
        raise ValueError(f"vocab_size {vocab_size} cannot hold the specials and ASCII")
    vocab = {tok: i for i, tok in enumerate(specials + vocab_words(vocab_size - len(specials)))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token=UNK_TOKEN, continuing_subword_prefix="",
                                     max_input_chars_per_word=10_000))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix=_NO_JOIN_PREFIX, cleanup=False)
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token=UNK_TOKEN, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False)  # no "a ." -> "a." rewrite: ids round-trip
    fast.chat_template = CHAT_TEMPLATE
    return fast
