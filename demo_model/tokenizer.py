"""Byte-level BPE tokenizer for the demo model, saved in Hugging Face format.

Why these choices: byte-level so any text round-trips with no unknown token; digits are split
one per token so that a pass key is copied digit by digit (a multi-digit merge would make recall
depend on which numbers happened to be frequent); ~4k vocabulary keeps the embedding small.
``<|endoftext|>`` is bos, eos and pad; the post-processor prepends it, as every training document
starts after one. ``<|user|>``/``<|assistant|>`` exist only for the simple chat template: the model
never saw them in training (it is not a chat model).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS = "<|endoftext|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SPECIAL_TOKENS = (EOS, USER, ASSISTANT)
VOCAB_SIZE = 4096
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + '<|endoftext|>\\n' }}"
    "{% else %}{{ message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the BPE on ``texts`` (the training split only, so held-out text stays unseen)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos_id)])
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (with ``chat_template``) and
    ``special_tokens_map.json`` so that ``transformers.AutoTokenizer`` and kvserve both load it."""
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None,
        additional_special_tokens=[USER, ASSISTANT], model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    hf.save_pretrained(str(out_dir))
    # Newer transformers writes the template to chat_template.jinja; the issue (and simpler
    # loaders) want it inside tokenizer_config.json, so keep it there and drop the extra file.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    smap = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS,
            "additional_special_tokens": [USER, ASSISTANT]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")
