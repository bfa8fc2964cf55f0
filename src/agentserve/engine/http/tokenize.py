"""POST /tokenize and /detokenize, as vLLM's: a prompt's token ids (text, or chat messages
rendered by the chat template) and their count, or ids back to text.

Agent harnesses count a context's tokens before they send it (to compact in time); the
ids are the same the generation endpoints would compute for the same input.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from agentserve.api.openai import (APIError, Message, Tool, check_prompt_ids, decode)
from agentserve.engine.http.serving import EngineClient
from agentserve.prompt.chat import chat_messages, chat_prompts


class TokenizeRequest(Struct, kw_only=True, omit_defaults=True):
    """vLLM's two tokenize requests in one: ``prompt`` text, or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    # default: True for a prompt (as /v1/completions), False for messages (the template
    # writes its own BOS), as vLLM
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True, omit_defaults=True):
    model: str | None = None
    tokens: list[int]


def tokenize(engine: EngineClient, body: bytes) -> dict[str, Any]:
    """The ``/tokenize`` answer: ``count``, ``max_model_len``, ``tokens``, ``token_strs``."""
    req = decode(body, TokenizeRequest)
    tok = engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send either prompt (text) or messages (a chat), not both or "
                       "neither", "prompt")
    if req.messages is not None:
        if not req.messages:
            raise APIError(400, "messages must not be empty", "messages")
        tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
        try:
            ids = chat_prompts(engine).ids(
                chat_messages(req.messages), tools, req.add_generation_prompt,
                req.continue_final_message, bool(req.add_special_tokens))
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
    else:
        ids = tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens is not False)
    strs = [tok.token_bytes(t).decode("utf-8", errors="replace") for t in ids] \
        if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize(engine: EngineClient, body: bytes) -> dict[str, Any]:
    """The ``/detokenize`` answer: ``prompt``, the text of ``tokens``."""
    req = decode(body, DetokenizeRequest)
    check_prompt_ids(req.tokens, engine.tokenizer.vocab_size, "tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
