"""Tokenizer, chat template and incremental detokenizer for the engine front end.

`Tokenizer.from_dir` reads a Hugging Face model folder without `transformers`:
`tokenizer.json` (the `tokenizers` library), `tokenizer_config.json` (special
tokens, `chat_template`; `chat_template.jinja` wins where present) and, if present,
`generation_config.json` (EOS ids). `Tokenizer.from_gguf` reads the same from a GGUF file
(prompt/gguf_vocab.py).

`IncrementalDetokenizer` turns a stream of token ids into a stream of text
deltas. It uses vLLM's prefix/read offset trick: decode a short window of
already-emitted tokens plus the new ones and emit only the new suffix, so
byte-level BPE never leaks half a UTF-8 character (text ending in U+FFFD is
held until the next token completes it). Text that could be the start of a
stop string is held back too, and output is truncated at the stop string.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2.ext import loopcontrols
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

from agentserve.prompt.toolprompt import hermes_messages, renders_tools

# Added tokens that carry content for the tool-call parser: keep them in the
# decoded text even when the tokenizer marks them special.
TEXT_SPECIAL_TOKENS = ("<tool_call>", "</tool_call>")
# vLLM decodes this many prompt tokens before the first output token so that
# tokenizers which strip a leading space (sentencepiece) decode it correctly.
_CONTEXT_TOKENS = 5
_MAX_HELD = 8  # tokens a stream may wait for one character to complete (a char <= 4 bytes)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """The `tojson` filter as Hugging Face defines it (no HTML escaping)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox HF uses (trim/lstrip blocks, loopcontrols)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character BPE pieces use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class Tokenizer:
    """A `tokenizers` tokenizer plus what HF keeps in tokenizer_config.json."""

    def __init__(self, hf: HFTokenizer, config: dict[str, Any] | None = None,
                 eos_token_ids: list[int] | None = None) -> None:
        self.hf = hf
        self.config = config or {}
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self.special_ids: set[int] = {i for i, t in added.items() if t.special}
        # Ids dropped by decode(skip_special_tokens=True): special, minus tool markers.
        keep = {self.token_id(t) for t in TEXT_SPECIAL_TOKENS}
        self.skip_ids: frozenset[int] = frozenset(self.special_ids - keep)
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.bos_token = _token_content(self.config.get("bos_token"))
        eos = list(eos_token_ids or [])
        if self.eos_token is not None and (tid := self.token_id(self.eos_token)) is not None:
            if tid not in eos:
                eos.append(tid)
        self.eos_token_ids: list[int] = eos
        template = self.config.get("chat_template")
        if isinstance(template, list):  # HF allows named templates; take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template
        self._template: jinja2.Template | None = (
            compile_chat_template(template) if template else None)
        self._byte_level = isinstance(hf.decoder, ByteLevelDecoder)
        self._added = set(added)
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and generation_config.json."""
        d = Path(model_dir)
        hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (d / "tokenizer_config.json").exists():
            config = json.loads((d / "tokenizer_config.json").read_text())
        if (d / "chat_template.jinja").is_file():  # newer HF folders keep the template here
            config["chat_template"] = (d / "chat_template.jinja").read_text()
        eos: list[int] = []
        if (d / "generation_config.json").exists():
            gen = json.loads((d / "generation_config.json").read_text())
            value = gen.get("eos_token_id")
            eos = [value] if isinstance(value, int) else list(value or [])
        return cls(hf, config, eos)

    @classmethod
    def from_gguf(cls, source: str | Path | Any) -> Tokenizer:
        """The vocabulary, special tokens, EOS ids and chat template a GGUF file (or an open
        `gguf.GGUFReader`) carries."""
        from gguf import GGUFReader

        from agentserve.prompt import gguf_vocab

        reader = GGUFReader(str(source)) if isinstance(source, (str, Path)) else source
        fields = reader.fields
        return cls(gguf_vocab.build_tokenizer(fields), gguf_vocab.tokenizer_config(fields),
                   gguf_vocab.eos_token_ids(fields))

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. "<|im_end|>"), or None."""
        return self.hf.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; added tokens written literally are matched."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs ``bytes``): a byte-level BPE
        piece may be part of a character, which ``decode([id])`` shows as U+FFFD."""
        cached = self._bytes.get(token_id)
        if cached is None:
            piece = self.hf.id_to_token(token_id) or ""
            if self._byte_level and token_id not in self._added and all(
                    c in _UNICODE_TO_BYTE for c in piece):
                cached = bytes(_UNICODE_TO_BYTE[c] for c in piece)
            else:
                cached = self.hf.decode([token_id], skip_special_tokens=False).encode()
            self._bytes[token_id] = cached
        return cached

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; tool-call markers survive skip_special_tokens."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.skip_ids]
        return self.hf.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's chat template (as HF does).

        Raises ValueError when the model has no template or the template rejects
        the conversation (the message says why).
        """
        if self._template is None:
            raise ValueError("this model has no chat_template; use /v1/completions")
        if not renders_tools(self.chat_template, self._template):  # (prompt/toolprompt.py)
            messages, tools = hermes_messages(messages, tools), None
        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e


def continue_final(prompt: str, final: str) -> str:
    """``prompt`` (a conversation rendered without a generation prompt) cut right after the
    final message's text, so the model continues that message (vLLM's and HF's
    ``continue_final_message``: an assistant message as a prefix of the answer).

    Raises ValueError when the text is empty or the template did not render it verbatim."""
    i = prompt.rfind(final) if final else -1
    if i < 0:
        raise ValueError("continue_final_message: the final message's text is empty or not "
                         "in the rendered prompt")
    return prompt[:i + len(final)]


class IncrementalDetokenizer:
    """Token ids in, text deltas out; stops at (and hides) the first stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 stop: list[str] | None = None, skip_special_tokens: bool = True,
                 skip_ids: set[int] | None = None, min_tokens: int = 0) -> None:
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.min_tokens = min_tokens  # vLLM: stop strings count only from this many tokens on
        self.num_tokens = 0
        self._skip = set(tokenizer.skip_ids) if skip_special_tokens else set()
        self._skip |= skip_ids or set()
        # the prompt's last few tokens that are shown, found from its end (a 240K-token
        # prompt filtered whole cost ~8 ms on the event loop per request)
        context: list[int] = []
        for i in reversed(prompt_ids or ()):
            if len(context) == _CONTEXT_TOKENS:
                break
            if i not in self._skip:
                context.append(i)
        context.reverse()
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.pending = ""  # decoded text held back because it may start a stop string
        self.text = ""  # everything emitted so far
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended it, if one did

    def _decode_new(self) -> str:
        """Text of tokens past read_offset, holding back only a character still in progress.

        A character is at most 4 bytes, so when the text ends in U+FFFD the character in
        progress lies in the last 3 tokens: the longest cut among those that decodes cleanly
        is let out. When none does, the tail holds bytes that are invalid UTF-8 (a weak model
        can emit hundreds in a row); after `_MAX_HELD` tokens they are let out as U+FFFD, all
        but the last 3, so a stream never stalls on them and each step decodes a bounded
        window."""
        def text(end: int) -> str:
            return self.tok.hf.decode(self.ids[self.prefix_offset:end], skip_special_tokens=False)

        prefix, end = text(self.read_offset), len(self.ids)
        full = text(end)
        if full.endswith("\ufffd"):
            for cut in range(end - 1, max(end - 4, self.read_offset), -1):
                head = text(cut)
                if not head.endswith("\ufffd"):
                    end, full = cut, head
                    break
            else:
                if end - self.read_offset <= _MAX_HELD:
                    return ""
                end -= 3
                full = text(end)
        if len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, end
        return full[len(prefix):]

    def _hold_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, new_ids: list[int]) -> tuple[str, bool]:
        """Add tokens; return (text delta, stopped). After a stop, returns ("", True)."""
        if self.stopped:
            return "", True
        self.ids.extend(i for i in new_ids if i not in self._skip)
        self.num_tokens += len(new_ids)
        buf = self.pending + self._decode_new()
        if self.num_tokens < self.min_tokens:  # too early for a stop: emit all, hold nothing
            self.pending = ""
            self.text += buf
            return buf, False
        found = [(i, s) for s in self.stop if (i := buf.find(s)) >= 0]
        cut = min(found)[0] if found else -1
        if cut >= 0:
            self.stopped = True
            self.stop_string = min(found)[1]
            self.pending = ""
            delta = buf[:cut]
        else:
            hold = self._hold_len(buf)
            delta, self.pending = buf[:len(buf) - hold], buf[len(buf) - hold:]
        self.text += delta
        return delta, self.stopped

    def flush(self) -> str:
        """At the end of generation: release held-back text (no stop string came)."""
        if self.stopped:
            return ""
        # Whatever is still undecoded ends mid-character: emit it as HF's full decode would.
        prefix = self.tok.hf.decode(self.ids[self.prefix_offset:self.read_offset],
                                    skip_special_tokens=False)
        full = self.tok.hf.decode(self.ids[self.prefix_offset:], skip_special_tokens=False)
        rest = full[len(prefix):]
        delta = self.pending + rest
        self.pending = ""
        self.read_offset = self.prefix_offset = len(self.ids)
        self.text += delta
        return delta
