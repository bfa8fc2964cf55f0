"""One HTTP request with raw bytes and headers, bounded, for the reliability suites.

`send` writes exactly the body and header bytes it is given (http.client adds only Host
and, when absent, Content-Length), so that a fuzzer can send what a well-behaved client
library refuses to (invalid UTF-8, odd header bytes, a wrong Content-Type). Every read
has a socket timeout and the whole exchange a deadline: a server that does not answer in
time is a `hang`, never a stuck client. Server-sent events are read to their end and
their error events collected (OpenAI: ``data: {"error": ...}``; Anthropic and Responses:
``event: error``, ``response.failed``).
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

KEEP = 2000  # bytes of a body kept for the report
# error types / codes that say the server failed (not the request): a 5xx in a stream
SERVER_SIDE = {"server_error", "service_unavailable", "api_error", "overloaded_error",
               "500", "502", "503", "504", "upstream_error"}
_ENDS = {"message_stop", "response.completed", "response.incomplete"}


@dataclass(slots=True)
class Result:
    """What one request got. `status` None: no response (`error` says why)."""

    status: int | None
    elapsed: float
    body: bytes = b""
    error: str | None = None  # "hang: ..." (a deadline passed) or "dropped: ..." (closed)
    stream: bool = False
    events: int = 0
    done: bool = False  # a stream reached its end marker ([DONE], message_stop, ...)
    stream_errors: list[str] = field(default_factory=list)  # each error event's text

    @property
    def hang(self) -> bool:
        return bool(self.error and self.error.startswith("hang"))

    @property
    def server_fault(self) -> bool:
        """A 5xx status, or a 200 stream that ended in a server-side error event."""
        return (self.status is not None and self.status >= 500) or any(
            _is_server_side(e) for e in self.stream_errors)


def _is_server_side(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return True
    if not isinstance(obj, dict):
        return True
    if obj.get("type") == "response.failed":  # the error is the response's
        obj = obj.get("response") if isinstance(obj.get("response"), dict) else {}
    err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
    return str(err.get("type")) in SERVER_SIDE or str(err.get("code")) in SERVER_SIDE


def send(base: str, method: str, path: str, headers: dict[str, bytes | str] | None = None,
         body: bytes | None = None, timeout: float = 30.0, deadline: float = 60.0,
         stop_after_events: int | None = None, keep: int = KEEP) -> Result:
    """One request to ``base`` (``http://host:port``); a new connection each time.
    `stop_after_events`: close the connection after that many stream events (a client
    that leaves mid-stream); `keep`: bytes of a plain body kept in the result."""
    u = urlsplit(base)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        names = {k.lower() for k in headers or {}}
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None and "content-length" not in names:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        res = Result(resp.status, 0.0)
        if (resp.getheader("Content-Type") or "").startswith("text/event-stream"):
            _read_stream(resp, res, t0 + deadline, stop_after_events)
        else:
            res.body = resp.read()[:keep]
    except TimeoutError as e:
        return Result(None, time.monotonic() - t0, error=f"hang: no answer within {timeout:.0f} "
                      f"s of a read ({e})")
    except (OSError, http.client.HTTPException) as e:
        return Result(None, time.monotonic() - t0, error=f"dropped: {type(e).__name__}: {e}")
    finally:
        conn.close()
    res.elapsed = time.monotonic() - t0
    if res.elapsed > deadline and not res.error:
        res.error = f"hang: took {res.elapsed:.1f} s (deadline {deadline:.0f} s)"
    return res


def _read_stream(resp: http.client.HTTPResponse, res: Result, until: float,
                 stop_after: int | None) -> None:
    res.stream, kept, event = True, bytearray(), ""
    while True:
        if time.monotonic() > until:
            res.error = "hang: stream not finished by its deadline"
            return
        line = resp.readline(1 << 20)
        if not line:
            return
        if len(kept) < KEEP:
            kept += line
            res.body = bytes(kept[:KEEP])
        text = line.decode("utf-8", "replace").strip()
        if text.startswith("event:"):
            event = text[6:].strip()
        elif text.startswith("data:"):
            data = text[5:].strip()
            res.events += 1
            _on_data(res, event, data)
            event = ""
            if stop_after is not None and res.events >= stop_after:
                return
        if res.done:
            return


def _on_data(res: Result, event: str, data: str) -> None:
    if data == "[DONE]":
        res.done = True
        return
    try:
        obj = json.loads(data)
    except ValueError:
        res.stream_errors.append(f"not JSON: {data[:200]}")
        return
    kind = obj.get("type") if isinstance(obj, dict) else None
    if event in ("error", "response.failed") or kind in ("error", "response.failed") or (
            isinstance(obj, dict) and "error" in obj and obj["error"] is not None
            and kind is None):
        res.stream_errors.append(data[:500])
        if event or kind:  # a named stream's error event is its last
            res.done = True
    elif event in _ENDS or kind in _ENDS:
        res.done = True
