"""The tokenizer and chat template a GGUF file carries, as a `tokenizers` tokenizer.

llama.cpp keeps a byte-level BPE vocabulary as metadata (`tokenizer.ggml.*`): the token
strings in GPT-2's byte alphabet, the merges as "left right" strings, a type per token
(3 = control: the special tokens) and the name of the pre-tokenizer (`tokenizer.ggml.pre`),
which stands for the regex split the original `tokenizer.json` ran before BPE. We rebuild
that tokenizer with the `tokenizers` library, so encode/decode are the Hugging Face ones:

    gpt2    ByteLevel(use_regex)                       (GPT-2's split)
    smollm  Digits(individual) + ByteLevel(use_regex)   (SmolLM/SmolLM2, cosmo2 tokenizer)

`tokenizer_config` gives what HF keeps in tokenizer_config.json (BOS/EOS/UNK/PAD strings,
added_tokens_decoder, chat_template), so the result also serves as a converted folder's files.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

GGUF_TOKEN_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: a special token
GGUF_TOKEN_USER_DEFINED = 4  # an added token that is not special

_PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
}


class GGUFVocabError(ValueError):
    """A GGUF vocabulary we cannot rebuild; the message names what is unsupported."""


def field(fields: dict[str, Any], key: str, default: Any = None) -> Any:
    """The value of a GGUFReader field (`ReaderField.contents()`), or `default`."""
    f = fields.get(key)
    return default if f is None else f.contents()


def build_tokenizer(fields: dict[str, Any]) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to the one the GGUF was converted from."""
    model = field(fields, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFVocabError(f"GGUF tokenizer model {model!r} is not supported; only 'gpt2' "
                             "(byte-level BPE)")
    pre = field(fields, "tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFVocabError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                             f"{', '.join(sorted(_PRE_TOKENIZERS))}")
    tokens: list[str] = field(fields, "tokenizer.ggml.tokens") or []
    if not tokens:
        raise GGUFVocabError("the GGUF holds no tokenizer.ggml.tokens")
    types: list[int] = field(fields, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in field(fields, "tokenizer.ggml.merges") or []]
    unk_id = field(fields, "tokenizer.ggml.unknown_token_id")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=tokens[unk_id] if unk_id is not None
                               else None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # added tokens keep their ids (they are in the vocab already); order by id as HF saves them
    added = [(i, types[i] == GGUF_TOKEN_CONTROL) for i in range(len(tokens))
             if types[i] in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)]
    tok.add_tokens([AddedToken(tokens[i], special=s, normalized=False) for i, s in added])
    return tok


def tokenizer_config(fields: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json as HF writes it for this vocabulary (with the chat template)."""
    tokens: list[str] = field(fields, "tokenizer.ggml.tokens") or []
    types: list[int] = field(fields, "tokenizer.ggml.token_type") or [1] * len(tokens)

    def name(key: str) -> str | None:
        i = field(fields, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    added = {str(i): dict(content=tokens[i], lstrip=False, normalized=False, rstrip=False,
                          single_word=False, special=types[i] == GGUF_TOKEN_CONTROL)
             for i in range(len(tokens)) if types[i] in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)}
    cfg: dict[str, Any] = dict(
        tokenizer_class="PreTrainedTokenizerFast", added_tokens_decoder=added,
        bos_token=name("bos"), eos_token=name("eos"), unk_token=name("unknown"),
        pad_token=name("padding"), add_bos_token=bool(field(fields, "tokenizer.ggml.add_bos_token",
                                                            False)),
        clean_up_tokenization_spaces=False, model_max_length=field(
            fields, f"{field(fields, 'general.architecture', 'llama')}.context_length", 8192))
    template = field(fields, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return cfg


def eos_token_ids(fields: dict[str, Any]) -> list[int]:
    """The EOS ids generation stops on (llama.cpp also stops on `eot_token_id`)."""
    ids = [field(fields, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    return list(dict.fromkeys(i for i in ids if i is not None))
