"""A checkpoint's recommended sampling settings (its `generation_config.json`) as the
defaults of requests that leave those fields unset.

vLLM's `--generation-config` (vllm-project/vllm, vllm/config/model.py,
`ModelConfig.get_diff_sampling_param`): `auto` reads the model's own file, `vllm` ignores
it (the server's neutral defaults: temperature 1, top_p 1, top_k and min_p off,
repetition_penalty 1, max_tokens as scheduler/limits.py says), a folder reads the one in
that folder. Of the file, the fields vLLM takes: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as the default max_tokens. `do_sample` is not
read, as vLLM does not read it: a file with `do_sample: false` and a temperature samples
at that temperature. A value the client sends always wins (server/sampling_fields.py),
and max_new_tokens only lowers the default max_tokens (scheduler/resolve.py).

No torch here: the CLI checks the flag with it before the model loads.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, fields

FILE = "generation_config.json"
SOURCES = ("auto", "vllm")  # or a folder
# The sampling fields a file may set, by their SamplingParams names: (type, check, rule)
_CHECKS = {
    "temperature": (float, lambda v: v >= 0, ">= 0"),
    "top_p": (float, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (int, lambda v: v >= -1, "-1, 0 (off) or positive"),
    "min_p": (float, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": (float, lambda v: v > 0, "> 0"),
    "max_new_tokens": (int, lambda v: v >= 1, ">= 1"),
}
logger = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults one file set (None: not set there, the server's own applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens
    source: str | None = None  # the file read (None: none)

    def sampling(self) -> dict[str, float | int]:
        """The sampling fields set (not max_tokens), by SamplingParams' names."""
        return {f.name: v for f in fields(self)
                if f.name not in ("max_tokens", "source") and (v := getattr(self, f.name))
                is not None}

    def describe(self) -> str:
        taken = {**self.sampling(), **({} if self.max_tokens is None
                                       else {"max_tokens": self.max_tokens})}
        return ", ".join(f"{k}={v}" for k, v in taken.items())


NO_DEFAULTS = SamplingDefaults()  # `vllm`, or a file that sets none of the fields


def config_file(model: str, generation_config: str = "auto") -> str | None:
    """The file `--generation-config` reads (None: `vllm`, or `auto` on a model without
    one). Raises ValueError for a folder that does not exist or holds no such file."""
    if generation_config == "vllm":
        return None
    if generation_config == "auto":
        path = os.path.join(model, FILE)
        return path if os.path.isfile(path) else None
    if not os.path.isdir(generation_config):
        raise ValueError(f"no such directory (give auto, vllm or a folder with {FILE})")
    path = os.path.join(generation_config, FILE)
    if not os.path.isfile(path):
        raise ValueError(f"the folder has no {FILE}")
    return path


def read_sampling_defaults(model: str, generation_config: str = "auto") -> SamplingDefaults:
    """The defaults `generation_config` (auto | vllm | a folder) gives the model in
    folder `model`. Raises ValueError naming the file, and its field, when a value is of
    the wrong type or out of range (never a default a request could not have sent)."""
    path = config_file(model, generation_config)
    if path is None:
        return NO_DEFAULTS
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    found: dict[str, float | int] = {}
    for name, (kind, ok, rule) in _CHECKS.items():
        value = raw.get(name)
        if value is None:
            continue
        wanted = (int,) if kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, wanted) or not math.isfinite(value):
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{path}: {name} must be {what}, not {value!r}")
        if not ok(value):
            raise ValueError(f"{path}: {name} must be {rule}, not {value!r}")
        found["max_tokens" if name == "max_new_tokens" else name] = kind(value)
    return SamplingDefaults(**found, source=path) if found else NO_DEFAULTS  # type: ignore[arg-type]


def load_sampling_defaults(model: str, generation_config: str = "auto") -> SamplingDefaults:
    """`read_sampling_defaults`, and the start-up line saying what was taken from where
    (vLLM's "Default sampling parameters have been overridden by the model's Hugging
    Face generation config")."""
    defaults = read_sampling_defaults(model, generation_config)
    fields_ = {"generation_config": generation_config, "source": defaults.source,
               "defaults": {**defaults.sampling(), "max_tokens": defaults.max_tokens}}
    if defaults.source is not None:
        logger.info(f"default sampling parameters from {defaults.source}: "
                    f"{defaults.describe()} (for requests that leave them unset; "
                    "--generation-config vllm ignores the file)", extra={"fields": fields_})
    else:
        why = ("--generation-config vllm" if generation_config == "vllm"
               else "the generation config sets none")
        logger.info(f"default sampling parameters: kvserve's own ({why})",
                    extra={"fields": fields_})
    return defaults
