"""`agentserve model convert FILE.gguf --out DIR`: a GGUF file as a Hugging Face folder.

The folder holds what `checkpoint.load_model`, transformers and vLLM read: `model.safetensors`
(dequantized, HF names, Q/K rows back in HF order), `config.json`, `generation_config.json`,
`tokenizer.json`, `tokenizer_config.json` (with the chat template) and `chat_template.jinja`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from agentserve.engine.model.gguf import open_gguf, read_gguf
from agentserve.prompt import gguf_vocab

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert_gguf(path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the HF folder of GGUF file `path` to `out_dir` (weights in `dtype`); return it."""
    from safetensors.torch import save_file

    if dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    reader = open_gguf(path)
    config, weights = read_gguf(reader, DTYPE_NAMES[dtype])
    fields = reader.fields
    tok = gguf_vocab.build_tokenizer(fields)
    tok_config = gguf_vocab.tokenizer_config(fields)
    config["torch_dtype"] = dtype
    eos = gguf_vocab.eos_token_ids(fields)
    generation = dict(bos_token_id=config["bos_token_id"],
                      eos_token_id=eos[0] if len(eos) == 1 else eos, do_sample=False)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # as make_tiny: readable by a vLLM run as another user
    tok.save(str(out / "tokenizer.json"))
    files = {"config.json": config, "generation_config.json": generation,
             "tokenizer_config.json": tok_config}
    for name, d in files.items():
        (out / name).write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n")
    if tok_config.get("chat_template"):
        (out / "chat_template.jinja").write_text(tok_config["chat_template"])
    return out
