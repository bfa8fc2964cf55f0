"""OpenAI (completions, chat, responses) and Anthropic Messages request bodies ->
`RouteInput` (validation, session key, tokenization).

Malformed requests are rejected here with a message (HTTP 400) before any backend is
touched. Prompts given as token ids are used as they are; text and chat prompts are
tokenized with the model's tokenizer (incrementally, see `tokenize.py`). Without a
tokenizer, text prompts are routed by load only (no prefix information).

The session key is the `x-session-id` header, else the body's `user` field (a Messages
body's `metadata.user_id`, where Claude Code names its session; a Responses body's
`prompt_cache_key`, where Codex names its conversation).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import msgspec

from agentserve.api.anthropic import MessagesRequest
from agentserve.api.anthropic import to_chat as messages_to_chat
from agentserve.prompt.chat import chat_messages
from agentserve.api.openai import MAX_N, APIError, decode
from agentserve.api.responses import ResponsesRequest
from agentserve.api.responses import to_chat as responses_to_chat
from agentserve.prompt.tokenizer import continue_final
from agentserve.router.config import RouterConfig
from agentserve.router.core import RouteInput
from agentserve.prompt.rawprompt import RawParse, RawPromptCache
from agentserve.prompt.incremental import IncrementalTokenizer, Tokenized

logger = logging.getLogger(__name__)
_DECODER = msgspec.json.Decoder()


class BadRequest(ValueError):
    """The request cannot be served as sent; the message says what to fix."""


def _max_tokens(req: dict[str, Any]) -> int:
    v = req.get("max_completion_tokens", req.get("max_tokens"))
    if v is None:
        return 256
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise BadRequest("max_tokens must be a non-negative integer")
    return v


def _flag(req: dict[str, Any], name: str, default: bool) -> bool:
    v = req.get(name, default)
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be a boolean")
    return v


def _samples(req: dict[str, Any]) -> int:
    """The body's ``n`` when it is one the engines accept (1-``MAX_N``), else 1: the engine
    then answers an out-of-range ``n`` with its own 400."""
    n = req.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


def _prompt_input(req: dict[str, Any], tok: IncrementalTokenizer | None,
                  session: str | None, raw: RawParse | None = None) -> RouteInput:
    if raw is not None and raw.entry is not None:  # token ids read incrementally from bytes
        e = raw.entry
        return RouteInput(e.ids, tokenized=Tokenized(e.ids, e, raw.base, raw.shared))
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tok is None:
            return RouteInput([])
        t = tok.text(prompt, add_special_tokens=_flag(req, "add_special_tokens", True),
                     session=session)
        return RouteInput(t.ids, tokenized=t)
    if isinstance(prompt, list):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            if not prompt:
                raise BadRequest("prompt must not be empty")
            return RouteInput(prompt)
        if all(isinstance(x, (str, list)) for x in prompt):
            return RouteInput([])  # a batch: no single prefix to route by
    raise BadRequest("prompt must be a string, a list of token ids, or a list of those")


def _chat_input(req: dict[str, Any], tok: IncrementalTokenizer | None) -> RouteInput:
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a string 'role'")
    tools = req.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    agp = _flag(req, "add_generation_prompt", True)
    if _flag(req, "continue_final_message", False):
        return _continued_input(messages, tools, agp, tok)
    if tok is None:
        return RouteInput([])
    try:
        t = tok.chat(messages, tools=tools, add_generation_prompt=agp)
    except ValueError as e:  # template rejected the conversation
        raise BadRequest(str(e)) from e
    except Exception as e:  # a template may raise anything on odd input
        raise BadRequest(f"chat template failed on these messages: {e}") from e
    return RouteInput(t.ids, tokenized=t)


def _continued_input(messages: list[Any], tools: Any, agp: bool,
                     tok: IncrementalTokenizer | None) -> RouteInput:
    """A chat continuing its final message (vLLM's continue_final_message): rendered and
    cut as the engine does (`tokenizer.continue_final`), tokenized as text."""
    if agp:
        raise BadRequest("continue_final_message and add_generation_prompt cannot both be true")
    if tok is None:
        return RouteInput([])
    final = messages[-1].get("content")
    if isinstance(final, list):  # text parts, joined as the engine joins them
        final = "\n".join(p.get("text") or "" for p in final if isinstance(p, dict))
    try:
        text = tok.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=False)
        text = continue_final(text, final if isinstance(final, str) else "")
    except Exception as e:  # a template may raise anything on odd input
        raise BadRequest(f"chat template failed on these messages: {e}") from e
    t = tok.text(text, add_special_tokens=False)
    return RouteInput(t.ids, tokenized=t)


def _converted_input(path: str, body: bytes, headers: Any,
                     tok: IncrementalTokenizer | None) -> RouteInput:
    """An Anthropic Messages or OpenAI Responses body, routed as the chat it stands for
    (rendered as the engine renders it: the same ``to_chat``)."""
    messages = path.startswith("/v1/messages")
    try:
        req = decode(body, MessagesRequest if messages else ResponsesRequest)
        chat = (messages_to_chat if messages else responses_to_chat)(req)  # type: ignore[arg-type]
    except APIError as e:
        raise BadRequest(e.message) from None
    use_tools = bool(chat.tools) and chat.tool_choice != "none"
    route = _chat_input({"messages": chat_messages(chat.messages),
                         "tools": msgspec.to_builtins(chat.tools) if use_tools else None,
                         "add_generation_prompt": chat.add_generation_prompt,
                         "continue_final_message": chat.continue_final_message}, tok)
    route.model, route.max_tokens = req.model, chat.max_tokens or 256
    route.session = headers.get("x-session-id") or chat.user
    return route


INTERNAL_FIELDS = ("kv_transfer_params",)  # body fields only the router may set


def strip_internal(body: bytes) -> tuple[bytes, dict[str, Any]] | None:
    """None when the body sets none of INTERNAL_FIELDS; else (the body without them, what
    it set). The cheap byte test comes first, so that ordinary bodies are not decoded
    twice; a body with JSON escapes (``"kv\\u005ftransfer_params"`` decodes to the same
    key, for us and for vLLM) is decoded to make sure."""
    if not any(f.encode() in body for f in INTERNAL_FIELDS) and b"\\u" not in body:
        return None
    try:
        req = _DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None  # parse_request answers it with a 400
    if not isinstance(req, dict) or not any(f in req for f in INTERNAL_FIELDS):
        return None
    found = {f: req.pop(f) for f in INTERNAL_FIELDS if f in req}
    return msgspec.json.encode(req), found


def parse_request(path: str, body: bytes, headers: Any,
                  tok: IncrementalTokenizer | None,
                  raw_cache: RawPromptCache | None = None) -> RouteInput:
    """Validate an OpenAI completions/chat body and build the routing input.

    With `raw_cache`, completions bodies whose prompt is a list of token ids are read
    incrementally from their bytes (`rawprompt.py`)."""
    t0 = time.perf_counter()
    if path.startswith(("/v1/messages", "/v1/responses")):
        route = _converted_input(path, body, headers, tok)
        route.parse_seconds = time.perf_counter() - t0
        return route
    chat = path.endswith("/chat/completions")
    raw: RawParse | None = None
    try:
        if raw_cache is not None and not chat:
            raw = raw_cache.parse(body, headers.get("x-session-id"))
            req = raw.req
        else:
            req = _DECODER.decode(body)
    except msgspec.DecodeError as e:
        raise BadRequest(f"body is not valid JSON: {e}") from e
    except RecursionError:  # msgspec's answer to arrays/objects nested thousands deep
        raise BadRequest("body is nested too deeply") from None
    if not isinstance(req, dict):
        raise BadRequest("body must be a JSON object")
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string")
    if "stream" in req and not isinstance(req["stream"], bool):
        raise BadRequest("stream must be a boolean")
    user = req.get("user")
    session = headers.get("x-session-id") or (user if isinstance(user, str) else None)
    if chat:
        route = _chat_input(req, tok)
    else:
        route = _prompt_input(req, tok, session, raw)
    route.model, route.session, route.max_tokens = model, session, _max_tokens(req)
    route.samples = _samples(req)
    route.parse_seconds = time.perf_counter() - t0
    return route


def load_tokenizer(cfg: RouterConfig) -> IncrementalTokenizer | None:
    """The tokenizer from `tokenizer:` / `--tokenizer`, else from an endpoint's `model` if
    that is a local model folder, else None (then only token-id prompts are prefix-routed)."""
    src = cfg.tokenizer or next((e.model for e in cfg.endpoints if e.model
                                 and (Path(e.model) / "tokenizer.json").exists()), None)
    if not src:
        return None
    from agentserve.prompt.tokenizer import Tokenizer

    d = Path(src)
    if d.suffix == ".gguf" and d.is_file():  # a GGUF carries its tokenizer (prompt/gguf_vocab.py)
        return IncrementalTokenizer(Tokenizer.from_gguf(d), cfg.options.tokenizer_cache_entries)
    if not (d / "tokenizer.json").exists():
        raise ValueError(f"--tokenizer {d}: no tokenizer.json there; pass the model folder")
    return IncrementalTokenizer(Tokenizer.from_dir(d), cfg.options.tokenizer_cache_entries)
