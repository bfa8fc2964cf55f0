"""`agentserve route`: the KV-cache-aware router in front of engines (ours or vLLM)."""

from __future__ import annotations

import logging
from typing import Optional

import typer


def route(
    config: Optional[str] = typer.Option(None, help="Router YAML (policy, endpoints, scorers)."),
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(8080, help="Port."),
    endpoint: list[str] = typer.Option([], "--endpoint", help="Extra backend URL (repeatable; "
                                       "no KV events: approximate prefix tracking)."),
    tokenizer: Optional[str] = typer.Option(None, help="Model folder with tokenizer.json "
                                            "(for text and chat prompts)."),
    api_key: Optional[str] = typer.Option(None, help="Require 'Authorization: Bearer KEY' "
                                          "(also enables /admin)."),
    kv_transfer_token: Optional[str] = typer.Option(
        None, envvar="AGENTSERVE_KV_TRANSFER_TOKEN", help="The P/D engines' shared secret: the "
        "router signs each leg's kv_transfer_params with it (agentserve engines refuse unsigned "
        "ones; vLLM ignores the signature)."),
    operator_key: Optional[str] = typer.Option(
        None, envvar="AGENTSERVE_OPERATOR_KEY", help="Callers sending it in "
        "x-agentserve-operator-key keep their own kv_transfer_params (signed); everyone "
        "else's are removed."),
    policy: Optional[str] = typer.Option(None, help="Override the config's policy."),
    http_header_timeout: Optional[float] = typer.Option(
        None, help="Seconds a connection has to send a complete request head, from when it "
        "opened or its last response ended [options.header_timeout_s: 30]."),
    http_body_timeout: Optional[float] = typer.Option(
        None, help="A request body silent this many seconds is answered 408 "
        "[options.body_timeout_s: 60]."),
    max_connections: Optional[int] = typer.Option(
        None, help="Open connections at most; more are answered 503 [options.max_connections: "
        "2048]."),
    drain_timeout: Optional[float] = typer.Option(
        None, help="On SIGTERM: seconds in-flight requests may finish before they are cut "
        "[options.drain_timeout_s: 30]."),
    log_level: str = typer.Option("info", help="Logging level."),
) -> None:
    """Route OpenAI requests to the endpoint that holds their prefix (KV events), by load."""
    import yaml

    from agentserve.router.config import EndpointConfig, build_config
    from agentserve.router.serve import run

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        raw = (yaml.safe_load(open(config).read()) or {}) if config else {}
        if policy:
            raw["policy"] = policy
        flags = {"header_timeout_s": http_header_timeout, "body_timeout_s": http_body_timeout,
                 "max_connections": max_connections, "drain_timeout_s": drain_timeout}
        if any(v is not None for v in flags.values()):  # over the file's options
            raw["options"] = {**(raw.get("options") or {}),
                              **{k: v for k, v in flags.items() if v is not None}}
        cfg = build_config(raw)
        cfg.endpoints += [EndpointConfig(url=u) for u in endpoint]
        cfg.api_key = api_key or cfg.api_key
        cfg.kv_transfer_token = kv_transfer_token or cfg.kv_transfer_token
        cfg.operator_key = operator_key or cfg.operator_key
        cfg.tokenizer = tokenizer or cfg.tokenizer
        if not cfg.endpoints:
            raise ValueError("no endpoints: give --config with endpoints: or --endpoint URL")
        run(cfg, host, port, config)
    except (ValueError, OSError, yaml.YAMLError) as e:
        typer.echo(f"agentserve route: {e}", err=True)
        raise typer.Exit(2) from e


def register(app: typer.Typer) -> None:
    """Add `route` to the `agentserve` command."""
    app.command("route")(route)
