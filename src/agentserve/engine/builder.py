"""Assemble an engine from command-line style arguments: model, KV pool, scheduler, events."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentserve.engine.model.checkpoint import CheckpointError, load_model
from agentserve.engine.model.gguf import PRESETS as GGUF_PRESETS
from agentserve.engine.model.gguf import is_gguf, load_gguf_model, open_gguf, resolve_model
from agentserve.engine.core.loop import EngineCore
from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.model.llama import KVCache
from agentserve.engine.model.mla import allocate_latent, latent_bytes_per_token
from agentserve.engine.model.mla_checkpoint import MlaConfig
from agentserve.engine.model.runner import ModelRunner
from agentserve.engine.core.scheduler import Scheduler
from agentserve.prompt.tokenizer import Tokenizer
from agentserve.kv.remote.client import RemoteConfig, RemoteKV
from agentserve.api.kv_transfer import TransferPolicy, parse_peers
from agentserve.kv.remote.wire import TcpBackend
from agentserve.kv.offload.connector import TierConnector
from agentserve.kv.offload.factory import make_connector
from agentserve.kv.events import KVEventQueue
from agentserve.kv.zmq_events import KVEventPublisher
from agentserve.kv.hashing import BlockHasher
from agentserve.kv.manager import KVCacheManager
from agentserve.kv.pool import BlockPool
from agentserve.kv.offload.tiers import TierConfig

log = logging.getLogger("agentserve.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV capacity when neither --kv-cache-tokens nor --kv-cache-gib is given: 131,072 tokens,
# capped at 4 GiB (vLLM's CPU default space) so a larger model (SmolLM2 in fp32 is ~46 KB a
# token, 5.6 GiB for 131,072) does not reserve more than a laptop has.
DEFAULT_KV_TOKENS = 131_072
DEFAULT_KV_GIB = 4.0


class EngineConfigError(ValueError):
    """A bad engine argument, with a message that says what to change."""


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None  # HF folder, GGUF file or preset (smollm2-135m); None = built-in tiny
    served_model_name: str | list[str] | None = None  # a list: the first, then aliases
    dtype: str = "auto"  # auto: the checkpoint's own (config.json `torch_dtype`), as vLLM
    device: str = "cpu"
    block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_cache_gib: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # cap on one request's prefill chunk (0: off; None: half of max_num_batched_tokens, so a
    # long prompt leaves room in every step for the requests behind it)
    long_prefill_token_threshold: int | None = None
    max_tokens_limit: int = 0  # the most tokens one request generates (0: the context limit)
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None  # default: $PYTHONHASHSEED, as vLLM
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = "kv-events"
    kv_events_options: dict[str, int] = field(default_factory=dict)  # buffer_steps, hwm, max_queue
    gpu_memory_utilization: float | None = None  # vLLM's KV sizing on CUDA; ignored on CPU, as vLLM
    seed: int = 0
    check_invariants: bool = False
    # Offload tiers (None / 0: off, exactly the device-only engine).
    kv_cpu_gib: float | None = None
    kv_cpu_policy: str = "lru"
    kv_disk_dir: str | None = None
    kv_disk_gib: float | None = None
    kv_offload_block_tokens: int | None = None
    kv_store_threshold: int = 1
    kv_store_on: str = "fill"  # fill (write-through) | evict (write-back: a victim cache)
    kv_max_loads: int = 4
    kv_session_ttl: float = 600.0
    kv_restore_mode: str = "auto"
    # Prefill/decode disaggregation (kv/remote/client.py).
    role: str = "both"  # both | prefill | decode
    kv_transfer_port: int | None = None  # None: any free port; -1: transfer off (role both only)
    kv_transfer_host: str = "127.0.0.1"  # advertised in remote_host (and bound)
    kv_transfer_timeout: float = 120.0  # seconds pinned prefill blocks wait for their pull
    kv_transfer_token: str | None = None  # shared secret; default $AGENTSERVE_KV_TRANSFER_TOKEN
    insecure_transfer: bool = False  # no token needed; unsigned kv_transfer_params acted on
    kv_transfer_peers: str | None = None  # "host:port,...": the only transfer servers pulled from


def _check_scheduler_args(args: EngineArgs) -> None:
    if args.long_prefill_token_threshold is not None and args.long_prefill_token_threshold < 0:
        raise EngineConfigError("--long-prefill-token-threshold must be >= 0 (0: off), got "
                                f"{args.long_prefill_token_threshold}")
    if args.max_tokens_limit < 0:
        raise EngineConfigError(f"--max-tokens-limit must be >= 0 (0: none but the context "
                                f"limit), got {args.max_tokens_limit}")


def chunk_cap(args: EngineArgs) -> int:
    """The prefill chunk cap per request and step (0: off). By default half the step's
    token budget: a 72K-token prompt otherwise takes every step's whole budget until it is
    in, and short requests behind it wait for all of it (measured on the tiny model, 16K
    prompt: three 8-token requests' TTFT 5.4 s -> 0.36 s; the lone prompt's prefill +12%)."""
    if args.long_prefill_token_threshold is not None:
        return args.long_prefill_token_threshold
    return max(1, args.max_num_batched_tokens // 2)


def _tier_config(args: EngineArgs) -> TierConfig | None:
    """The offload-tier settings, validated; None when no CPU tier is asked for."""
    if not args.kv_cpu_gib:
        if args.kv_disk_dir:
            raise EngineConfigError("--kv-disk-dir needs a CPU tier in front of it: add --kv-cpu-gib")
        return None
    if args.kv_cpu_gib < 0 or (args.kv_disk_dir and not args.kv_disk_gib):
        raise EngineConfigError("--kv-cpu-gib must be > 0, and --kv-disk-dir needs --kv-disk-gib > 0")
    if not args.enable_prefix_caching:
        raise EngineConfigError("KV offload tiers need prefix caching; drop --no-prefix-caching")
    if args.kv_cpu_policy not in ("lru", "arc", "session"):
        raise EngineConfigError(f"--kv-cpu-policy must be lru, arc or session, got {args.kv_cpu_policy!r}")
    if args.kv_restore_mode not in ("auto", "always", "never"):
        raise EngineConfigError(f"--kv-restore must be auto, always or never, got {args.kv_restore_mode!r}")
    if args.kv_store_on not in ("fill", "evict"):
        raise EngineConfigError(f"--kv-store-on must be fill or evict, got {args.kv_store_on!r}")
    if args.kv_store_threshold < 1 or args.kv_max_loads < 1:
        raise EngineConfigError("--kv-store-threshold and --kv-max-loads must be >= 1")
    return TierConfig(cpu_bytes=int(args.kv_cpu_gib * 2**30), disk_dir=args.kv_disk_dir,
                      disk_bytes=int((args.kv_disk_gib or 0) * 2**30),
                      block_tokens=args.kv_offload_block_tokens, cpu_policy=args.kv_cpu_policy,
                      store_threshold=args.kv_store_threshold, store_on=args.kv_store_on,
                      max_loads=args.kv_max_loads,
                      session_ttl=args.kv_session_ttl, restore_mode=args.kv_restore_mode)


def resolve_dtype(name: str, model_dir: Path, device: str) -> str:
    """`--dtype` as a concrete name. `auto` is the checkpoint's dtype (`torch_dtype`, or
    `dtype` in newer configs; float32 when it says none); a float16 checkpoint runs in
    bfloat16 on CPU, as vLLM does there (CPU float16 kernels are slow or missing)."""
    if name != "auto":
        if name not in DTYPES:
            raise EngineConfigError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
        return name
    path = model_dir / "config.json"
    if not path.is_file():  # as the checkpoint loader says it
        raise CheckpointError(f"no config.json in {model_dir}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from e
    got = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if got not in DTYPES:
        raise EngineConfigError(f"--dtype auto: the checkpoint's dtype {got!r} is not one of "
                                f"{sorted(DTYPES)}; pass --dtype explicitly")
    if got == "float16" and not device.startswith("cuda"):
        log.warning("the checkpoint is float16; running it in bfloat16 on %s (pass --dtype "
                    "float16 to force float16)", device)
        return "bfloat16"
    return got


def _build_tiers(args: EngineArgs, kv_cache: KVCache, pool: BlockPool, cfg: object,
                 model_dir: Path, dtype_name: str) -> TierConnector | None:
    tcfg = _tier_config(args)
    if tcfg is None:
        return None
    # Disk blocks are only valid for this model, dtype, block layout and hash chain.
    ident = f"{model_dir.resolve()}|{cfg}|{dtype_name}|{args.block_size}|{args.hash_algo}|{args.hash_seed}"
    try:
        return make_connector(tcfg, kv_cache.k, kv_cache.v, pool,
                              hashlib.sha256(ident.encode()).digest())
    except (ValueError, OSError) as e:
        raise EngineConfigError(str(e)) from e


def _transfer_on(args: EngineArgs) -> bool:
    """Whether this engine serves KV transfer (prefill/decode roles; ``both`` opt-in)."""
    if args.role not in ("both", "prefill", "decode"):
        raise EngineConfigError(f"--role must be both, prefill or decode, got {args.role!r}")
    return not (args.kv_transfer_port == -1
                or (args.role == "both" and args.kv_transfer_port is None))


def _transfer_auth(args: EngineArgs) -> tuple[str, frozenset[tuple[str, int]] | None]:
    """The cluster secret and the peer allow-list, checked before the model loads. An
    engine serving KV transfer refuses to start without a secret unless told it runs on a
    trusted network (--insecure-transfer)."""
    if args.kv_transfer_timeout <= 0:
        raise EngineConfigError("--kv-transfer-timeout must be > 0 seconds")
    token = args.kv_transfer_token or os.environ.get("AGENTSERVE_KV_TRANSFER_TOKEN", "")
    if not token and not args.insecure_transfer:
        raise EngineConfigError(
            f"--role {args.role} with KV transfer needs a shared secret: give --kv-transfer-token "
            "(or AGENTSERVE_KV_TRANSFER_TOKEN; `agentserve up` makes one), or --insecure-transfer "
            "to let anyone who reaches the ports pull KV and steer transfers")
    try:
        peers = parse_peers(args.kv_transfer_peers)
    except ValueError as e:
        raise EngineConfigError(str(e)) from None
    if args.insecure_transfer:
        log.warning("--insecure-transfer: kv_transfer_params are acted on unsigned and %s; use "
                    "it only on a trusted network", "the transfer port authenticates nothing"
                    if not token else "the transfer port still checks the token")
    return token, peers


def _build_remote(args: EngineArgs, kv_cache: KVCache, pool: BlockPool,
                  auth: tuple[str, frozenset[tuple[str, int]] | None] | None) -> RemoteKV | None:
    """The P/D transfer service (``auth``: `_transfer_auth`'s, None when transfer is off)."""
    if auth is None:
        return None
    cfg = RemoteConfig(host=args.kv_transfer_host, port=args.kv_transfer_port or 0,
                       timeout=args.kv_transfer_timeout)
    try:
        return RemoteKV(cfg, TcpBackend(auth[0], peers=auth[1]), pool, kv_cache.k, kv_cache.v)
    except OSError as e:
        raise EngineConfigError(f"cannot listen for KV transfers on {cfg.host}:{cfg.port}: {e}") from e


def transfer_policy(args: EngineArgs, auth: tuple[str, frozenset[tuple[str, int]] | None] | None,
                    hasher: BlockHasher, max_len: int) -> TransferPolicy:
    """What the API edge accepts in kv_transfer_params (`engine.transfer_params`)."""
    token, peers = auth or ("", None)
    return TransferPolicy(enabled=auth is not None, token=token, insecure=args.insecure_transfer,
                          block_size=args.block_size, hash_bytes=len(hasher.none_hash),
                          max_blocks=max_len // args.block_size + 2, peers=peers)


def _num_blocks(args: EngineArgs, bytes_per_token: int) -> int:
    if args.kv_cache_tokens is not None and args.kv_cache_gib is not None:
        raise EngineConfigError("give either --kv-cache-tokens or --kv-cache-gib, not both")
    util = args.gpu_memory_utilization
    if util is not None and args.device.startswith("cuda"):
        if args.kv_cache_tokens is not None or args.kv_cache_gib is not None:
            raise EngineConfigError("give --gpu-memory-utilization or a KV size "
                                    "(--kv-cache-tokens / --kv-cache-gib), not both")
        free, total = torch.cuda.mem_get_info(torch.device(args.device))
        tokens = gpu_kv_bytes(util, free, total) // bytes_per_token
    elif args.kv_cache_gib is not None:
        if args.kv_cache_gib <= 0:
            raise EngineConfigError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
        tokens = int(args.kv_cache_gib * 2**30) // bytes_per_token
    elif args.kv_cache_tokens is not None:
        tokens = args.kv_cache_tokens
    else:
        tokens = min(DEFAULT_KV_TOKENS, int(DEFAULT_KV_GIB * 2**30) // bytes_per_token)
    blocks = tokens // args.block_size
    if blocks < 2:
        raise EngineConfigError(f"KV cache of {tokens} tokens holds fewer than 2 blocks of "
                                f"{args.block_size}; raise --kv-cache-tokens or --kv-cache-gib")
    return blocks


def gpu_kv_bytes(utilization: float, free: int, total: int) -> int:
    """KV bytes that `--gpu-memory-utilization` leaves after the model loaded: vLLM's rule,
    the fraction of the device's memory this process may use minus what is in use now."""
    if not 0.0 < utilization <= 1.0:
        raise EngineConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    budget = int(utilization * total) - (total - free)
    if budget <= 0:
        raise EngineConfigError(f"--gpu-memory-utilization {utilization}: the device has "
                                f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use "
                                "already, nothing is left for the KV cache")
    return budget


def _default_name(model: str | None, model_dir: Path) -> str:
    """The served name when none is given: a preset's own name, a GGUF file's name without
    `.gguf`, a folder's name, `agentserve-tiny` for the built-in model."""
    if model is None:
        return "agentserve-tiny"
    if model in GGUF_PRESETS:
        return model
    return model_dir.name.removesuffix(".gguf")


def build_engine(args: EngineArgs) -> AsyncEngine:
    """Load the model and wire pool, hasher, scheduler, runner and event publisher."""
    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise EngineConfigError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {args.dtype!r}")
    if args.block_size <= 0:
        raise EngineConfigError(f"--block-size must be positive, got {args.block_size}")
    if args.gpu_memory_utilization is not None and not args.device.startswith("cuda"):
        # vLLM's CPU backend sizes its KV by VLLM_CPU_KVCACHE_SPACE and ignores this flag too
        log.warning("--gpu-memory-utilization %s is ignored on %s; the KV cache is sized by "
                    "--kv-cache-tokens / --kv-cache-gib", args.gpu_memory_utilization, args.device)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineConfigError("--device cuda requested but torch sees no CUDA device")
    auth = _transfer_auth(args) if _transfer_on(args) else None
    if args.model is None:
        from agentserve.engine.model.tiny import default_model_dir

        model_dir = default_model_dir()
    else:
        model_dir = resolve_model(args.model)
    gguf_file = is_gguf(model_dir)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if gguf_file:  # auto: float32, which holds every dequantized GGUF weight exactly
        dtype_name = resolve_dtype("float32" if args.dtype == "auto" else args.dtype, model_dir,
                                   args.device)
        gguf_reader = open_gguf(model_dir)
        model, cfg = load_gguf_model(gguf_reader, dtype=DTYPES[dtype_name], device=str(device))
    else:
        dtype_name = resolve_dtype(args.dtype, model_dir, args.device)
        model, cfg = load_model(model_dir, dtype=DTYPES[dtype_name], device=str(device))
    dtype = DTYPES[dtype_name]
    if isinstance(cfg, MlaConfig):  # one latent per token and layer (mla.py)
        if _tier_config(args) is not None or auth is not None:
            raise EngineConfigError("KV offload tiers and KV transfer do not handle the mla-moe "
                                    "latent cache yet; drop --kv-cpu-gib / --role / --kv-transfer-port")
        num_blocks = _num_blocks(args, latent_bytes_per_token(cfg, dtype))
        kv_cache = allocate_latent(cfg, num_blocks, args.block_size, dtype, device)
    else:
        num_blocks = _num_blocks(args, KVCache.bytes_per_token(cfg, dtype))
        kv_cache = KVCache.allocate(cfg, num_blocks, args.block_size, dtype, device)
    max_len = min(cfg.max_position_embeddings, num_blocks * args.block_size)
    if args.max_model_len is not None:
        if args.max_model_len > max_len:
            raise EngineConfigError(f"--max-model-len {args.max_model_len} exceeds what the model and "
                                    f"KV cache allow ({max_len} tokens)")
        max_len = args.max_model_len
    events = KVEventQueue() if args.kv_events_endpoint else None
    pool = BlockPool(num_blocks, args.block_size, enable_caching=args.enable_prefix_caching,
                     events=events)
    hasher = BlockHasher(algo=args.hash_algo, block_size=args.block_size, seed=args.hash_seed)
    kv = KVCacheManager(pool, hasher, enable_caching=args.enable_prefix_caching)
    tiers = _build_tiers(args, kv_cache, pool, cfg, model_dir, dtype_name)
    remote = _build_remote(args, kv_cache, pool, auth)
    _check_scheduler_args(args)
    scheduler = Scheduler(kv, args.max_num_seqs, args.max_num_batched_tokens, tiers, remote,
                          long_prefill_token_threshold=chunk_cap(args))
    runner = ModelRunner(model, kv_cache, args.block_size, device)
    publisher = None
    if args.kv_events_endpoint:
        publisher = KVEventPublisher(args.kv_events_endpoint, topic=args.kv_events_topic,
                                     replay_endpoint=args.kv_events_replay_endpoint,
                                     **args.kv_events_options)
    tokenizer = Tokenizer.from_gguf(gguf_reader) if gguf_file else Tokenizer.from_dir(model_dir)
    core = EngineCore(scheduler, runner, tokenizer.eos_token_ids, max_len, events, publisher,
                      check_invariants=args.check_invariants)
    names = args.served_model_name or [_default_name(args.model, model_dir)]
    names = [names] if isinstance(names, str) else list(dict.fromkeys(names))
    log.info("engine ready: model=%s dtype=%s blocks=%d x %d tokens, max_model_len=%d",
             "/".join(names), dtype_name, num_blocks, args.block_size, max_len)
    engine = AsyncEngine(core, tokenizer, names[0], model_dir, max_len, device)
    engine.model_names = names
    engine.role = args.role
    engine.max_tokens_limit = args.max_tokens_limit
    engine.transfer_policy = transfer_policy(args, auth, hasher, max_len)
    if remote is not None:
        log.info("KV transfer (%s) on %s:%d, role %s", remote.backend.name, args.kv_transfer_host,
                 remote.port, args.role)
    return engine
