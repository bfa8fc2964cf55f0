"""What ran: the `run` block a summary.json stage carries, so a report can say it.

Bench stamps the target (URL, model, trace, mode, API) at the start of a run; `run_info` adds
what any producer (bench, the simulator) can say of itself: the UTC date, the command line,
versions (agentserve, Python, torch: read from package metadata, never imported, which costs
seconds) and the machine (CPU count and architecture; no hostname).
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from importlib import metadata


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed (the program's base name, then its arguments, shell-quoted);
    an API key given on the command line is masked."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    out = [os.path.basename(argv[0])]
    hide = False
    for a in argv[1:]:
        if hide:
            out.append("***")
            hide = False
        elif a == "--api-key":
            out.append(a)
            hide = True
        elif a.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(a)
    return shlex.join(out)


def run_info(extra: dict | None = None, argv: list[str] | None = None) -> dict:
    """The `run` block: `extra` (the producer's own fields) over date, command, versions, machine."""
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": command_line(argv),
        "versions": {"agentserve": _version("agentserve"), "python": platform.python_version(),
                     "torch": _version("torch")},
        "machine": {"cpus": os.cpu_count(), "arch": platform.machine(),
                    "os": f"{platform.system()} {platform.release()}"},
    }
    info.update(extra or {})
    return info
