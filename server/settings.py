"""Server-side settings (everything that is not the engine's own config)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from server.tenants import Tenant, make_tenants


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=lambda: ["kvserve"])
    model_path: str = ""
    # API keys: each one is a tenant (`tenant0`, `tenant1`, ... in this order). `api_key`
    # is the single-key form and goes first when both are given.
    api_key: str | None = field(default=None, repr=False)
    api_keys: list[str] = field(default_factory=list, repr=False)
    max_body_bytes: int = 8 * 2**20
    drain_timeout: float = 30.0
    request_log: bool = True  # one structured line per finished request
    # Tool calling (server/tools.py): the parser that reads "auto" calls from the model's
    # text (vLLM's --tool-call-parser, server/tool_parsers/), and whether "auto" is on
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # Reasoning (server/reasoning/): splits chat answers into reasoning_content and
    # content (vLLM's --reasoning-parser); None: the text is all answer
    reasoning_parser: str | None = None
    # /v1/responses (server/responses_api.py): how many stored responses
    # previous_response_id can name; the least recently used goes first
    responses_store_size: int = 1000
    # Called when the model fails to load in the background, so the CLI can exit
    # non-zero instead of serving 503s forever.
    on_fatal: Callable[[BaseException], None] | None = None
    tenants: list[Tenant] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        from server.reasoning import REASONING_PARSERS

        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning_parser {self.reasoning_parser!r}")
        keys = list(self.api_keys)
        if self.api_key and self.api_key not in keys:
            keys.insert(0, self.api_key)
        self.tenants = make_tenants(keys)  # ValueError for empty or repeated keys

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser "auto" tool choice reads calls with; None where it is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @property
    def tenant_names(self) -> list[str]:
        return [t.name for t in self.tenants]
