"""`POST /v1/responses`, OpenAI's Responses API (what the OpenAI Agents SDK calls), on
top of the chat path: a request becomes a chat request (`request.py`: input items ->
messages, flat function tools -> chat tools, `previous_response_id` -> the stored
conversation), runs as one (the chat template, tool and reasoning parsers, constrained
decoding, `kv_policy`), and its answer is told back as Responses output items and
stream events (`output.py`). Stored responses live in a bounded LRU (`store.py`)."""

from __future__ import annotations

from server.responses_api.output import Turn
from server.responses_api.request import plan_turn
from server.responses_api.store import ResponseStore

__all__ = ["ResponseStore", "Turn", "plan_turn"]
