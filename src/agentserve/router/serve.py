"""Run the router's HTTP server in the foreground, bounded (``agentserve.api.httpbounds``).

Header and body timeouts and a connection cap from the router options; SIGTERM/SIGINT stop
listening, give in-flight requests ``drain_timeout_s`` to finish, cancel the rest and exit,
with a backstop that ends the process whatever hangs.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from aiohttp import web

from agentserve.api.httpbounds import (CappedSite, HttpLimits, hard_exit_after, listen_socket,
                                   raise_open_files_limit)
from agentserve.router import memtrim
from agentserve.router.config import Options, RouterConfig
from agentserve.router.gateway import Gateway

logger = logging.getLogger("agentserve.router.gateway")

# Past the drain: cancelling the handlers left, closing the engines' connections and the
# event subscribers; after it the process exits anyway.
HARD_EXIT_GRACE_S = 15.0


def limits_of(opts: Options) -> HttpLimits:
    """The HTTP bounds the router options set."""
    return HttpLimits(opts.header_timeout_s, opts.body_timeout_s, opts.max_connections)


async def serve(gw: Gateway, sock: socket.socket, stop: asyncio.Event) -> None:
    """Serve ``gw`` on the listening ``sock`` until ``stop`` is set, then drain: the
    listener closes, idle connections close, requests in flight get ``drain_timeout_s``
    before they are cancelled (aiohttp's graceful shutdown)."""
    limits = limits_of(gw.opts)
    raise_open_files_limit(limits.max_connections)
    runner = web.AppRunner(gw.app(), handle_signals=False, handler_cancellation=True,
                           access_log=None, shutdown_timeout=gw.opts.drain_timeout_s,
                           **limits.runner_kwargs())
    await runner.setup()
    try:
        site = CappedSite(runner, sock, limits.max_connections)
        await site.start()
        logger.info("routing on %s", site.name)
        await stop.wait()
        logger.info("shutting down: at most %.0f s for the requests in flight",
                    gw.opts.drain_timeout_s)
    finally:
        await runner.cleanup()


async def _main(gw: Gateway, host: str, port: int) -> None:
    sock = listen_socket(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def backstop() -> None:
        await stop.wait()
        hard_exit_after(gw.opts.drain_timeout_s + HARD_EXIT_GRACE_S, "router shutdown")

    watch = asyncio.create_task(backstop())
    trim = memtrim.start_from_env()  # glibc: give freed heap back every 30 s (memtrim.py)
    try:
        await serve(gw, sock, stop)
    finally:
        watch.cancel()
        if trim is not None:
            trim.cancel()


def run(cfg: RouterConfig, host: str, port: int, config_path: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT."""
    from agentserve.gcpause import freeze_startup_heap
    from agentserve.router.memtrace import start_from_env
    from agentserve.router.requests import load_tokenizer

    limits_of(cfg.options).check()
    gw = Gateway(cfg, config_path, load_tokenizer(cfg))
    memtrim.bpe_cache_from_env(gw.tokenizer)  # 1,000 words, not 10,000: memtrim.py
    freeze_startup_heap()  # full collections then skip the imports' objects (gcpause.py)
    start_from_env()  # debug only: AGENTSERVE_ROUTER_TRACEMALLOC=FILE (memtrace.py)
    asyncio.run(_main(gw, host, port))
