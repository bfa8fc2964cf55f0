"""Shared fixtures: a small BPE tokenizer folder (unit tests) and a real server (`served`)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# The engine tests that take it (engine core, tiers, P/D) run on this device; CI and `make test`
# use the CPU. `scripts/gpu_checks.sh` sets it to "cuda" on a machine with a GPU.
TEST_DEVICE = os.environ.get("AGENTSERVE_TEST_DEVICE", "cpu")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CHATML = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ('hello world, the quick brown fox jumps over the lazy dog. '
          '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}} '
          'héllo naïve café 日本語のテキスト 🙂🚀 stop STOP end.')


def build_tokenizer_dir(out: Path) -> Path:
    """Train a ~600-token byte-level BPE with ChatML specials into `out`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 10, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return out


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tok_dir: Path):
    from agentserve.prompt.tokenizer import Tokenizer as AsTokenizer
    return AsTokenizer.from_dir(tok_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The tokenizer of the built-in tiny checkpoint (built on first use, then cached)."""
    from agentserve.engine.model.tiny import default_model_dir
    from agentserve.prompt.tokenizer import Tokenizer as AsTokenizer
    return AsTokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="session")
def smollm2_engine(tmp_path_factory: pytest.TempPathFactory):
    """One engine process on the real SmolLM2 GGUF for every slow test that talks to it over
    HTTP (tools, the demo's chat, bench prompt sizes): a start costs 15-90 s on 2 cores, so
    it is paid once a session. Tests must not assume a cold prefix cache."""
    from agentserve.cluster.procs import start_engine

    p = start_engine(Path(tmp_path_factory.mktemp("smollm2")),
                     extra=["--model", "smollm2-135m", "--kv-cache-tokens", "8192"])
    try:
        p.wait_healthy(timeout=180)
        assert p.url is not None
        yield p
    finally:
        p.stop()


# ---- a real server on the tiny model (integration tests) ------------------------------------

API_KEY = "sk-test"
MAX_MODEL_LEN = 1024


class ServerThread:
    """Real engine + app on 127.0.0.1:<ephemeral port> in a background event loop."""

    def __init__(self, api_key: str | None = None, **engine_kwargs: Any) -> None:
        self.api_key, self.engine_kwargs = api_key, engine_kwargs
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as e:  # surfaced by start()
            self.error = e
            self.ready.set()

    async def _main(self) -> None:
        from aiohttp import web

        from agentserve.engine.core.engine import AsyncEngine
        from agentserve.engine.http.server import build_app

        self.engine = await asyncio.to_thread(AsyncEngine.from_args, **self.engine_kwargs)
        await self.engine.start()
        self.runner = web.AppRunner(build_app(self.engine, api_key=self.api_key,
                                              max_body_bytes=1 << 20))
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        self.stop = asyncio.Event()
        self.ready.set()
        await self.stop.wait()
        await self.engine.shutdown(drain_timeout=5)
        await self.runner.cleanup()

    def start(self) -> ServerThread:
        self.thread.start()
        assert self.ready.wait(180), "server did not start within 180 s"
        if self.error:
            raise self.error
        return self

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def served() -> Iterator[ServerThread]:
    """One server per test module: tiny model, small KV cache, invariant checks on."""
    server = ServerThread(api_key=API_KEY, model=None, kv_cache_tokens=8192, block_size=16,
                          max_model_len=MAX_MODEL_LEN, max_num_seqs=16, device=TEST_DEVICE,
                          max_num_batched_tokens=512, seed=0, check_invariants=True).start()
    yield server
    server.close()


def wait_idle(served: ServerThread, timeout: float = 10) -> None:
    """Block until the engine has no running or waiting requests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = served.engine.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout}s: {served.engine.stats()}")


def post(served: ServerThread, path: str, body: Any = None, key: str | None = API_KEY,
         raw: bytes | None = None) -> tuple[int, Any]:
    """Raw POST for inputs the official client refuses to send; returns (status, JSON)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(served.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
