"""Run the engine's HTTP server in the foreground with graceful SIGTERM/SIGINT handling."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from aiohttp import web

from agentserve.engine.builder import EngineArgs
from agentserve.engine.engine import AsyncEngine
from agentserve.engine.server import build_app
from agentserve.gcpause import freeze_startup_heap

log = logging.getLogger("agentserve.serve")


async def serve_async(args: EngineArgs, host: str, port: int, api_key: str | None,
                      max_body_bytes: int, drain_timeout: float = 30.0,
                      ready: asyncio.Event | None = None, freeze_gc: bool = False) -> None:
    """Serve until SIGTERM/SIGINT, then drain in-flight requests (bounded) and exit.

    ``freeze_gc``: freeze the startup heap once the engine is up (a serving process only;
    see ``agentserve.gcpause``)."""
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
    app = build_app(engine, api_key=api_key, max_body_bytes=max_body_bytes)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    log.info("serving %s on http://%s:%d", engine.model_name, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("shutting down: draining %d in-flight requests", engine.num_inflight)
    await engine.shutdown(drain_timeout)
    await runner.cleanup()


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for host:port (IPv4 or IPv6); OSError when taken."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e


def _as_kwargs(args: EngineArgs) -> dict:
    return {f: getattr(args, f) for f in args.__dataclass_fields__}


def run_server(args: EngineArgs, host: str, port: int, api_key: str | None = None,
               max_body_bytes: int = 32 << 20) -> None:
    asyncio.run(serve_async(args, host, port, api_key, max_body_bytes, freeze_gc=True))
