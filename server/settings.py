"""Server-side settings (everything that is not the engine's own config)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=lambda: ["kvserve"])
    model_path: str = ""
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    drain_timeout: float = 30.0
    request_log: bool = True  # one structured line per finished request
    # Called when the model fails to load in the background, so the CLI can exit
    # non-zero instead of serving 503s forever.
    on_fatal: Callable[[BaseException], None] | None = None
