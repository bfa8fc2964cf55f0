"""Two of our engines behind `agentserve route` (real processes, real KV events)."""

from pathlib import Path

import pytest
import yaml

from agentserve.engine.tiny import default_model_dir

from .procs import free_port, our_engine, router, stop, wait_http
from .sessions import run_sessions

pytestmark = pytest.mark.slow


def test_two_engines_precise_routing(tmp_path: Path):
    model = str(default_model_dir())
    ports = [free_port() for _ in range(2)]
    evs = [free_port() for _ in range(2)]
    rport = free_port()
    cfg = tmp_path / "router.yaml"
    cfg.write_text(yaml.safe_dump({"policy": "precise-prefix", "endpoints": [
        {"url": f"http://127.0.0.1:{p}", "kv_events": f"tcp://127.0.0.1:{e}", "block_size": 16}
        for p, e in zip(ports, evs)]}))
    procs = [our_engine(p, e, tmp_path / f"engine{i}.log")
             for i, (p, e) in enumerate(zip(ports, evs))]
    try:
        for p, proc in zip(ports, procs):
            wait_http(f"http://127.0.0.1:{p}/health", proc)
        procs.append(router(rport, cfg, tmp_path / "router.log", model))
        wait_http(f"http://127.0.0.1:{rport}/health", procs[-1], 60)
        rows = run_sessions(f"http://127.0.0.1:{rport}", n_sessions=4, turns=4)
    finally:
        stop(procs)
    later = [r for r in rows if r["turn"] > 0]
    for r in later:
        first = next(x for x in rows if x["session"] == r["session"] and x["turn"] == 0)
        assert r["endpoint"] == first["endpoint"], r
    assert all(r["predicted"] == r["cached"] for r in rows), rows
    assert sum(r["cached"] for r in later) > 0.8 * sum(r["prompt"] for r in later)
    assert len({r["endpoint"] for r in rows}) == 2  # sessions spread over both engines
