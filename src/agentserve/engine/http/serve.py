"""Run the engine's HTTP server in the foreground with graceful SIGTERM/SIGINT handling."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from agentserve.engine.builder import EngineArgs
from agentserve.engine.core.engine import AsyncEngine
from agentserve.engine.http.server import build_app
from agentserve.gcpause import freeze_startup_heap
from agentserve.api.httpbounds import (CappedSite, HttpLimits, hard_exit_after, listen_socket,
                                   raise_open_files_limit)

log = logging.getLogger("agentserve.serve")

HANDLER_GRACE_S = 2.0  # after the drain: for handlers to write their answers, then cancelled
# After the drain timeout: the core's stop (its thread, tier write-back) and the handlers'
# grace; past it the process exits anyway (``hard_exit_after``).
HARD_EXIT_GRACE_S = 15.0


async def serve_async(args: EngineArgs, host: str, port: int, api_key: str | None,
                      max_body_bytes: int, drain_timeout: float = 30.0,
                      ready: asyncio.Event | None = None, freeze_gc: bool = False,
                      limits: HttpLimits | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight requests (bounded) and exit.

    The shutdown is bounded: after ``drain_timeout`` the requests still running are
    aborted and answered 503 (see ``AsyncEngine.shutdown``), their handlers get
    ``HANDLER_GRACE_S`` to write that, and a backstop ends the process at
    ``drain_timeout + HARD_EXIT_GRACE_S`` whatever is stuck. ``limits``: the HTTP time and
    connection bounds (``agentserve.api.httpbounds``). ``freeze_gc``: freeze the startup heap
    once the engine is up (a serving process only; see ``agentserve.gcpause``)."""
    limits = limits or HttpLimits()
    limits.check()
    # Take the port before loading the model (as vLLM does): a taken port fails in
    # milliseconds, not after the weights are in memory.
    sock = listen_socket(host, port)
    try:
        engine = await asyncio.to_thread(AsyncEngine.from_args, **_as_kwargs(args))
    except BaseException:
        sock.close()
        raise
    await engine.start()
    if freeze_gc:
        freeze_startup_heap()
    raise_open_files_limit(limits.max_connections)
    app = build_app(engine, api_key=api_key, max_body_bytes=max_body_bytes,
                    body_timeout_s=limits.body_timeout_s)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=HANDLER_GRACE_S,
                           **limits.runner_kwargs())
    await runner.setup()
    site = CappedSite(runner, sock, limits.max_connections)
    await site.start()
    log.info("serving %s on http://%s:%d", engine.model_name, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    hard_exit_after(drain_timeout + HARD_EXIT_GRACE_S, "shutdown")
    log.info("shutting down: draining %d in-flight requests (at most %.0f s)",
             engine.num_inflight, drain_timeout)
    await engine.shutdown(drain_timeout)
    await runner.cleanup()


def _as_kwargs(args: EngineArgs) -> dict:
    return {f: getattr(args, f) for f in args.__dataclass_fields__}


def run_server(args: EngineArgs, host: str, port: int, api_key: str | None = None,
               max_body_bytes: int = 32 << 20, drain_timeout: float = 30.0,
               limits: HttpLimits | None = None) -> None:
    """``serve_async`` in a new event loop, as a serving process (the heap frozen)."""
    asyncio.run(serve_async(args, host, port, api_key, max_body_bytes, drain_timeout,
                            freeze_gc=True, limits=limits))
