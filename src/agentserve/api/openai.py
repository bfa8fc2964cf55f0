"""OpenAI request schemas, their validation, and OpenAI error objects.

Bodies are decoded with msgspec Structs that ignore unknown fields (as vLLM does);
type errors name the offending field. Range checks that msgspec cannot express
live in `check_*`. Every failure is an `APIError` carrying the HTTP status and the
OpenAI error object `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from msgspec import Struct

T = TypeVar("T")


class APIError(Exception):
    """An error the client can act on; `body()` is the OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


_TYPES = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
          500: "server_error", 503: "service_unavailable"}


class StreamOptions(Struct, kw_only=True, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far in every chunk


class _Sampling(Struct, kw_only=True, omit_defaults=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM P/D disaggregation (kv/remote/client.py)
    # vLLM: the prompt's and the output's token ids beside the text (token in, token out:
    # an agent or RL harness then never re-tokenizes what the model wrote)
    return_token_ids: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension, as HF's
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    min_tokens: int = 0  # vLLM: no EOS, stop token or stop string before this many tokens
    response_format: ResponseFormat | None = None
    # vLLM: the prompt tokens' logprobs (each given those before it), with the k most likely
    prompt_logprobs: int | None = None
    # Fields OpenAI or vLLM define that change what is generated and that this engine does
    # not implement: a non-default value is refused (check_unsupported), never ignored.
    best_of: int | None = None
    use_beam_search: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None
    logits_processors: Any = None


class JsonSchemaFormat(Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    schema: Any = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True, omit_defaults=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(_Sampling, kw_only=True, omit_defaults=True):
    prompt: str | list[Any]  # text, token ids, or a list of either
    add_special_tokens: bool = True  # vLLM: a text prompt gets the tokenizer's BOS etc.
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(Struct, kw_only=True, omit_defaults=True):
    type: str
    text: str | None = None


class FunctionCall(Struct, kw_only=True, omit_defaults=True):
    name: str
    arguments: str | dict[str, Any] = ""


class MessageToolCall(Struct, kw_only=True, omit_defaults=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class Message(Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: Any = None  # a JSON Schema object; checked when the grammar is built
    strict: bool | None = None


class Tool(Struct, kw_only=True, omit_defaults=True):
    function: FunctionDef
    type: str = "function"


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    function: NamedFunction
    type: str = "function"


class ChatRequest(_Sampling, kw_only=True, omit_defaults=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # vLLM: echo the last message (not implemented: refused when true)
    # vLLM: end the prompt with the assistant's generation prompt (default), or continue the
    # final message (its text is the answer's beginning: a "prefill"), not both
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# Samples per prompt (parallel sampling): each is its own engine request, and the prompt is
# computed once (the others wait for it in flight, kv/inflight.py). vLLM has no bound;
# this one keeps a single request from queueing thousands.
MAX_N = 128
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs

_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1  # vLLM's bound (torch.long), what a Generator takes

_PATH = re.compile(r"at `\$\.?(.*)`")


def check_utf8(body: bytes) -> None:
    """A 400 unless ``body`` is UTF-8 (RFC 8259's JSON). msgspec checks the strings it keeps,
    but skips an unknown key unread, so a mangled ``"max_\\xff_tokens"`` would silently mean
    "max_tokens unset" (generate to the context limit)."""
    if body.isascii():  # (most bodies; no copy)
        return
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start}): JSON must be "
                       "UTF-8 encoded") from None


def decode(body: bytes, kind: type[T]) -> T:
    """JSON body -> request Struct; malformed JSON or wrong types become 400s."""
    check_utf8(body)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e))
        raise APIError(400, f"invalid request: {e}", param=m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec's answer to arrays/objects nested thousands deep
        raise APIError(400, "request body is nested too deeply") from None


# field -> the values that mean "off" (vLLM's defaults); anything else is refused
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "use_beam_search": (False,),
    "allowed_token_ids": (None,), "bad_words": (None, []), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "logits_processors": (None,), "suffix": (None, ""),
}
_FORMATS = ("text", "json_object", "json_schema")


def check_unsupported(req: Struct) -> None:
    """A field this engine does not implement is refused unless it has its 'off' value."""
    for name, off in _UNSUPPORTED.items():
        value = getattr(req, name, None)
        if not any(value == v and type(value) is type(v) for v in off):
            hint = ("; use response_format json_schema" if name.startswith(("guided_", "struct"))
                    else "")
            raise APIError(400, f"{name} is not supported by this engine (got {value!r}){hint}",
                           name)


# field -> (allowed?, what the message says it must be); unset (None) fields pass
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: v >= 0, ">= 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v >= -1, "-1, 0 (disabled) or >= 1"),
    "max_tokens": (lambda v: v >= 1, ">= 1"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "min_tokens": (lambda v: v >= 0, ">= 0"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    # (vLLM: (0, 2]; below 1e-6 the penalty's 1/p overflows float32 logits)
    "repetition_penalty": (lambda v: 1e-6 <= v <= 2, "in [1e-6, 2]"),
    "seed": (lambda v: _SEED_MIN <= v <= _SEED_MAX, "a 64-bit signed integer"),
}


def check_sampling(req: _Sampling, allow_zero_tokens: bool = False) -> None:
    """Checks common to both endpoints: unsupported fields, ranges, bias, response_format.
    ``allow_zero_tokens``: max_tokens 0 is valid (a completion echoing its prompt only)."""
    check_unsupported(req)
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.n > 1 and req.kv_transfer_params:
        # one P/D leg is one request: a prefill leg pins one prompt's KV for one puller
        raise APIError(400, "kv_transfer_params needs n = 1 (a P/D leg is one sample)", "n")
    for name, (ok, what) in _RANGES.items():
        value = getattr(req, name)
        if value is not None and not ok(value) and not (allow_zero_tokens and name == "max_tokens"):
            if name == "max_tokens" and value == 0 and isinstance(req, CompletionRequest):
                what += " (0 only with echo=true: the prompt alone)"
            raise APIError(400, f"{name} must be {what}, got {value}", name)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options can only be set when stream is true (as vLLM)",
                       "stream_options")
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                           f"{req.prompt_logprobs}", "prompt_logprobs")
        if req.stream:  # (as vLLM: a stream's chunks have no place for them)
            raise APIError(400, "prompt_logprobs are not available when stream=true",
                           "prompt_logprobs")
    check_logit_bias(req.logit_bias)
    check_response_format(req.response_format)


def check_logit_bias(bias: dict[str, float] | None) -> None:
    """Keys are token ids (as strings), values in [-100, 100]; the vocabulary is checked
    where it is known (`serving.sampling_params`)."""
    for key, value in (bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value} for "
                           f"{key}", "logit_bias")


def check_response_format(fmt: ResponseFormat | None) -> None:
    if fmt is None:
        return
    if fmt.type not in _FORMATS:
        raise APIError(400, f"response_format.type must be one of {list(_FORMATS)}, got "
                       f"{fmt.type!r}", "response_format")
    if fmt.type == "json_schema" and (fmt.json_schema is None
                                      or not isinstance(fmt.json_schema.schema, dict)):
        raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON "
                       "Schema object", "response_format")


def check_completion(req: CompletionRequest) -> None:
    echo_only = req.echo and req.max_tokens == 0  # (as vLLM: the prompt alone, scored)
    check_sampling(req, allow_zero_tokens=echo_only)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
                       "logprobs")
    check_prompt_scoring(req, prompt_logprobs_of(req))


def prompt_logprobs_of(req: _Sampling) -> int | None:
    """How many top logprobs a request wants at each prompt position, or None: its
    ``prompt_logprobs``, else, for a completion echoing its prompt with logprobs, those
    (as vLLM: the echoed tokens carry logprobs too)."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo:
        return req.logprobs
    return None


def check_prompt_scoring(req: _Sampling, k: int | None) -> None:
    """A request scoring its prompt computes all of it on one engine: no P/D leg."""
    if k is not None and req.kv_transfer_params:
        raise APIError(400, "prompt logprobs (prompt_logprobs, or echo with logprobs) need the "
                       "whole prompt computed on one engine: not with kv_transfer_params",
                       "kv_transfer_params")


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def check_chat(req: ChatRequest) -> None:
    check_sampling(req)
    if req.max_completion_tokens is not None and req.max_completion_tokens <= 0:
        raise APIError(400, f"max_completion_tokens must be >= 1, got {req.max_completion_tokens}",
                       "max_completion_tokens")
    if req.top_logprobs is not None:
        if not req.logprobs:  # (as vLLM and OpenAI)
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                           f"{req.top_logprobs}", "top_logprobs")
    if req.echo:
        raise APIError(400, "echo is not supported for chat completions; send echo=false",
                       "echo")
    check_prompt_scoring(req, req.prompt_logprobs)
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be "
                       "true (as vLLM): send add_generation_prompt=false", "continue_final_message")
    if not req.messages:
        raise APIError(400, "messages must not be empty", "messages")
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {sorted(_ROLES)}, "
                           f"got {m.role!r}", f"messages[{i}].role")
        for part in m.content if isinstance(m.content, list) else []:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages[{i}]: only text content parts are supported, "
                               f"got type {part.type!r}", f"messages[{i}].content")
    check_tool_choice(req)


def check_tool_choice(req: ChatRequest) -> None:
    choice, names = req.tool_choice, [t.function.name for t in req.tools or []]
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        raise APIError(400, f"tool_choice must be 'auto', 'none', 'required' or a named function, "
                       f"got {choice!r}", "tool_choice")
    if (choice == "required" or isinstance(choice, NamedToolChoice)) and not names:
        raise APIError(400, "tool_choice requires tools; add tools or drop tool_choice",
                       "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not "
                       f"in tools {names}", "tool_choice")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def check_prompt_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    if not ids:
        raise APIError(400, "prompt must not be empty", param)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range [0, {vocab_size})", param)


def check_length(num_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    """Check the context limit; returns max_tokens (default: all the room left)."""
    if num_prompt >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your prompt has {num_prompt} tokens, leaving no room for output. "
                       "Please shorten the prompt.", "prompt", "context_length_exceeded")
    room = max_model_len - num_prompt
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, you requested {num_prompt + max_tokens} tokens ({num_prompt} in "
                       f"the prompt, {max_tokens} for the completion). Please reduce the prompt "
                       f"or max_tokens (at most {room} here).", "max_tokens",
                       "context_length_exceeded")
    return max_tokens
