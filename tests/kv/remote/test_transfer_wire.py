"""The TCP transfer backend alone: zero-copy and staged paths, chunking, reuse, faults."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from agentserve.kv.remote.backend import PullSpec
from agentserve.kv.remote.auth import client_handshake, server_handshake
from agentserve.kv.remote.frames import TransferError, block_shape, block_sums
from agentserve.kv.remote.wire import TcpBackend
from agentserve.kv.offload.copy import StagingBuffer, block_views, gather_blocks
from tests.conftest import TEST_DEVICE


class Source:
    """Every block of ``k``/``v`` pinned under request "r"; counts checkouts/checkins."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.busy = 0
        self.released: list[str] = []

    def checkout(self, rid: str, idx: list[int], hashes: list[bytes]) -> list[int]:
        if rid != "r":
            raise TransferError(f"no pinned KV for request {rid!r}")
        self.busy += 1
        return [i * 2 for i in idx]  # remote ids differ from the indices: runs of length 1

    def checkin(self, rid: str, release: bool) -> None:
        self.busy -= 1
        if release:
            self.released.append(rid)

    def release(self, rid: str) -> None:
        self.released.append(rid)


def cache(blocks: int = 40, dtype: torch.dtype = torch.float32, seed: int = 0,
          device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (3, blocks, 4, 2, 8)  # L, blocks, bs, H, D
    return (torch.randn(shape, generator=g).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))


def staged_device(staged: bool) -> str:
    """The staged path is the one device caches take: on a GPU machine its caches live there."""
    return TEST_DEVICE if staged else "cpu"


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_pull_into_matches_gather(staged: bool, dtype: torch.dtype, chunk: int) -> None:
    dev = staged_device(staged)
    k, v = cache(dtype=dtype, device=dev)
    src = Source(k, v)
    srv = TcpBackend("t", staged=staged)
    port = srv.serve(src, "127.0.0.1", 0)
    cli = TcpBackend("t", chunk_blocks=chunk, staged=staged)
    try:
        dk, dv = (torch.zeros(3, 30, 4, 2, 8, dtype=dtype, device=dev) for _ in "kv")
        dst = [29, 3, 4, 5, 6, 0, 1, 2, 10, 11]  # mixed runs on the receiving side
        idx = list(range(10))
        for _ in range(3):  # buffers and connections are reused across pulls
            n = cli.pull_into(PullSpec("127.0.0.1", port, "r", idx, [b""] * 10, release=False),
                              dk, dv, dst)
            assert n == 10 * 2 * 3 * 4 * 2 * 8 * k.element_size()
            want = gather_blocks(k, v, [i * 2 for i in idx])
            assert torch.equal(gather_blocks(dk, dv, dst), want)
        deadline = time.monotonic() + 5  # the server checks in right after its last send
        while src.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert src.busy == 0 and src.released == []
    finally:
        cli.close()
        srv.close()


def test_refused_and_size_mismatch_raise() -> None:
    k, v = cache()
    srv = TcpBackend("t")
    port = srv.serve(Source(k, v), "127.0.0.1", 0)
    cli = TcpBackend("t")
    try:
        with pytest.raises(TransferError, match="no pinned KV"):
            cli.pull_into(PullSpec("127.0.0.1", port, "x", [0], [b""]), k.clone(), v.clone(), [0])
        small = torch.zeros(3, 4, 4, 2, 4)  # head_dim differs
        with pytest.raises(TransferError, match="size mismatch"):
            cli.pull_into(PullSpec("127.0.0.1", port, "r", [0], [b""]), small, small.clone(), [0])
        # the connection that failed was dropped; the next pull works on a fresh one
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        cli.pull_into(PullSpec("127.0.0.1", port, "r", [1], [b""], release=False), dk, dv, [5])
        assert torch.equal(dk[:, 5], k[:, 2]) and torch.equal(dv[:, 5], v[:, 2])
    finally:
        cli.close()
        srv.close()


def test_corrupted_chunk_sum_is_detected() -> None:
    """A peer whose payload does not match its sums: the pull fails (the caller recomputes)."""
    from agentserve.kv.remote.frames import recv_header, send_frame

    k, v = cache(blocks=4)
    lst = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = lst.accept()
        with conn, lst:
            server_handshake(conn, "", time.monotonic() + 5)
            recv_header(conn)
            nbytes = 2 * block_shape(k)[1] * 4 * 2 * 8 * 4
            send_frame(conn, {"ok": True, "n": 1, "nbytes": nbytes, "block_shape": block_shape(k),
                              "dtype": "float32", "chunk_blocks": 64})
            conn.sendall(b"\1" * nbytes + (12345).to_bytes(8, "big"))

    threading.Thread(target=run, daemon=True).start()
    with pytest.raises(TransferError, match="checksum"):
        TcpBackend().pull_into(PullSpec("127.0.0.1", lst.getsockname()[1], "r", [0], [b""]),
                               k.clone(), v.clone(), [0])


def test_block_views_are_gather_order_and_staging_reuses() -> None:
    k, v = cache()
    ids = [3, 4, 5, 9, 1, 2]
    flat = torch.cat([t.reshape(-1) for t in block_views(k, v, ids)])
    assert torch.equal(flat, gather_blocks(k, v, ids).reshape(-1))
    st = StagingBuffer()
    a = st.get(1024, torch.float32, (256,))
    b = st.get(512, torch.float32, (128,))
    assert a.data_ptr() == b.data_ptr()  # no new allocation when it fits


class PinnedSource(Source):
    """``Source`` whose pins were checksummed when pinned (as ``RemoteKV.pin`` does)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__(k, v)
        self.sums = block_sums(k, v, list(range(k.shape[1])))
        self.asked = 0

    def pinned_sums(self, rid: str, idx: list[int]) -> list[int] | None:
        self.asked += 1
        return [self.sums[i * 2] for i in idx]


@pytest.mark.parametrize("staged", [False, True])
def test_pinned_sums_are_sent_and_every_byte_is_checked(staged: bool) -> None:
    """The sender trusts the sums taken at pin time; the receiver still sums every byte it
    gets: a wrong precomputed sum, or a pinned block changed after it, fails the pull."""
    dev = staged_device(staged)
    k, v = cache(device=dev)
    src = PinnedSource(k, v)
    srv = TcpBackend("t", staged=staged)
    port = srv.serve(src, "127.0.0.1", 0)
    cli = TcpBackend("t", chunk_blocks=4, staged=staged)
    spec = PullSpec("127.0.0.1", port, "r", list(range(10)), [b""] * 10, release=False)
    dst = [29, 3, 4, 5, 6, 0, 1, 2, 10, 11]
    try:
        dk, dv = (torch.zeros(3, 30, 4, 2, 8, device=dev) for _ in "kv")
        cli.pull_into(spec, dk, dv, dst)
        assert src.asked == 1
        assert torch.equal(gather_blocks(dk, dv, dst), gather_blocks(k, v, [i * 2 for i in range(10)]))
        src.sums[6] ^= 1 << 40  # block 6 = index 3: a corrupted precomputed sum
        with pytest.raises(TransferError, match="checksum"):
            cli.pull_into(spec, dk, dv, dst)
        src.sums[6] ^= 1 << 40
        cli.pull_into(spec, dk, dv, dst)  # a fresh connection; sums right again
        k[2, 14, 1, 1, 3] += 1.0  # the payload of a pinned block changed after its sums
        with pytest.raises(TransferError, match="checksum"):
            cli.pull_into(spec, dk, dv, dst)
        # without checksums nothing is summed or compared (the trailer is 0)
        TcpBackend("t", staged=staged, checksum=False).pull_into(spec, dk, dv, dst)
        assert torch.equal(gather_blocks(dk, dv, dst), gather_blocks(k, v, [i * 2 for i in range(10)]))
    finally:
        cli.close()
        srv.close()


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (3, 40, 4, 2, 8)),
                                         (torch.float16, (3, 40, 3, 1, 1)),  # 6-byte units
                                         (torch.bfloat16, (2, 40, 3, 1, 4))])
def test_block_sums_agree_with_every_cut(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from agentserve.kv.remote.frames import (
        MASK,
        _block_sums_torch,
        block_sums,
        cache_spans,
        span_groups,
        spans_sum,
        staged_sum,
    )

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    ids = [5, 6, 7, 1, 30, 31, 2, 39]
    per_block = block_sums(k, v, ids)
    assert per_block == _block_sums_torch(k, v, ids)  # the device path (run here on CPU)
    assert per_block == [block_sums(k, v, [i])[0] for i in ids]
    unit = shape[2] * shape[3] * shape[4] * k.element_size()
    want = staged_sum(gather_blocks(k, v, ids), unit)
    assert sum(per_block) & MASK == want
    for limit in (8, 64, 1 << 20):
        spans = cache_spans(k, v, ids, limit)
        assert sum(spans_sum(grp) for grp in span_groups(spans, limit)) & MASK == want


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (3, 40, 4, 2, 8)),
                                         (torch.float16, (3, 40, 3, 1, 1))])
def test_receive_in_small_groups_and_sum_tasks(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                               shape: tuple[int, ...]) -> None:
    """Receive groups and sum tasks that cut layers and runs every which way still add up."""
    import agentserve.kv.remote.wire as wire

    monkeypatch.setattr(wire, "RECV_GROUP_BYTES", 200)
    monkeypatch.setattr(wire, "SUM_CALL_BYTES", 300)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    srv = TcpBackend("t")
    port = srv.serve(PinnedSource(k, v), "127.0.0.1", 0)
    try:
        for chunk in (1, 3, 7, 64):
            cli = TcpBackend("t", chunk_blocks=chunk)
            dk, dv = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            dst = [29, 3, 4, 5, 6, 0, 1, 2, 10, 11, 12, 13, 14]
            cli.pull_into(PullSpec("127.0.0.1", port, "r", list(range(13)), [b""] * 13, release=False),
                          dk, dv, dst)
            assert torch.equal(gather_blocks(dk, dv, dst), gather_blocks(k, v, [i * 2 for i in range(13)]))
            cli.close()
    finally:
        srv.close()


def test_stalled_reader_frees_the_pins() -> None:
    """A decode side that asks for blocks and stops reading: the server's send times out
    and checks the pin back in (it would otherwise be held forever)."""
    from agentserve.kv.remote.frames import send_frame

    k, v = torch.randn(2, 32, 16, 8, 128), torch.randn(2, 32, 16, 8, 128)  # 256 KiB blocks
    src = Source(k, v)
    srv = TcpBackend("t", timeout=0.5)
    port = srv.serve(src, "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client_handshake(c, "t")
            send_frame(c, {"op": "pull", "rid": "r", "idx": list(range(16)),
                           "hashes": [b""] * 16, "release": True, "checksum": True})
            deadline = time.monotonic() + 10
            while not src.released and time.monotonic() < deadline:
                time.sleep(0.05)
            assert src.released == ["r"] and src.busy == 0
    finally:
        srv.close()


def test_stalled_sender_times_out() -> None:
    """A prefill side that stops mid-payload (alive, silent): the pull fails in time."""
    from agentserve.kv.remote.frames import recv_header, send_frame

    k, v = cache(blocks=4)
    lst = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def run() -> None:
        conn, _ = lst.accept()
        with conn, lst:
            server_handshake(conn, "", time.monotonic() + 5)
            recv_header(conn)
            send_frame(conn, {"ok": True, "n": 2, "nbytes": 2 * 768, "block_shape": block_shape(k),
                              "dtype": "float32", "chunk_blocks": 64})
            conn.sendall(b"\1" * 700)
            stop.wait(10)

    threading.Thread(target=run, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TransferError):
            TcpBackend(timeout=0.5).pull_into(
                PullSpec("127.0.0.1", lst.getsockname()[1], "r", [0, 1], [b"", b""]),
                k.clone(), v.clone(), [0, 1])
        assert time.monotonic() - t0 < 5
    finally:
        stop.set()


def test_block_ids_out_of_the_cache_are_refused() -> None:
    k, v = cache()
    src = Source(k, v)  # maps index i to block 2i: index 20 is block 40, past the 40 blocks
    srv = TcpBackend("t")
    port = srv.serve(src, "127.0.0.1", 0)
    cli = TcpBackend("t", timeout=5)
    try:
        with pytest.raises(TransferError, match="out of range"):
            cli.pull_into(PullSpec("127.0.0.1", port, "r", [19, 20], [b"", b""]), k.clone(), v.clone(), [0, 1])
        assert src.busy == 0
    finally:
        cli.close()
        srv.close()


def test_malformed_requests_get_an_error_frame_and_the_server_keeps_serving() -> None:
    """A peer with the token sending a request of the wrong shape gets ``ok: false`` with
    the reason (not a dropped connection and a traceback), nothing is checked out, and the
    next pull is served."""
    from agentserve.kv.remote.frames import recv_header, send_frame

    k, v = cache()
    src = Source(k, v)
    srv = TcpBackend("t")
    port = srv.serve(src, "127.0.0.1", 0)
    cli = TcpBackend("t", timeout=5)
    try:
        for bad in ({"idx": "0,1"}, {"idx": [0, "1"]}, {"hashes": 7}, {"chunk_blocks": "x"}):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                client_handshake(c, "t")
                send_frame(c, {"op": "pull", "rid": "r", "idx": [0], "hashes": [b""], **bad})
                head = recv_header(c)
            assert head["ok"] is False and "malformed request" in head["error"], (bad, head)
        for authed in (False, True):  # (before authenticating: refused as a failed proof)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                if authed:
                    client_handshake(c, "t")
                else:
                    recv_header(c)  # the challenge
                send_frame(c, ["not", "a", "map"])
                assert recv_header(c)["ok"] is False
        assert src.busy == 0
        k2, v2 = k.clone().zero_(), v.clone().zero_()
        cli.pull_into(PullSpec("127.0.0.1", port, "r", [0, 1], [b"", b""]), k2, v2, [0, 1])
        assert torch.equal(k2[:, 0], k[:, 0]) and torch.equal(v2[:, 1], v[:, 2])
    finally:
        cli.close()
        srv.close()


class Relay:
    """A TCP relay between a client and ``port`` that keeps every byte in both directions."""

    def __init__(self, port: int) -> None:
        self.lst = socket.create_server(("127.0.0.1", 0))
        self.port, self.target = self.lst.getsockname()[1], port
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.lst.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            with self._lock:
                self.seen += data
            dst.sendall(data)

    def close(self) -> None:
        self.lst.close()


def test_the_token_never_crosses_the_wire_and_a_wrong_one_is_refused() -> None:
    """Everything a pull and a release send, both ways, through a recording relay: the pull
    works, and neither the secret nor its hex form is in the bytes; a client holding
    another token is refused by name, and so is a server that cannot prove it holds it."""
    token = "the-cluster-secret-0123456789"
    k, v = cache()
    src = Source(k, v)
    srv = TcpBackend(token)
    relay = Relay(srv.serve(src, "127.0.0.1", 0))
    cli = TcpBackend(token, timeout=5)
    try:
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        cli.pull_into(PullSpec("127.0.0.1", relay.port, "r", [0, 1], [b"", b""], release=False),
                      dk, dv, [3, 4])
        cli.release("127.0.0.1", relay.port, "r")
        assert torch.equal(dk[:, 3], k[:, 0]) and src.released == ["r"]
        seen = bytes(relay.seen)
        assert len(seen) > 2 * dk[:, 0].numel() * 4  # (the payload went through the relay)
        for secret in (token.encode(), token.encode().hex().encode(), token.upper().encode()):
            assert secret not in seen
        with pytest.raises(TransferError, match="kv-transfer-token"):
            TcpBackend("wrong", timeout=5).pull_into(
                PullSpec("127.0.0.1", relay.port, "r", [0], [b""]), dk, dv, [0])
    finally:
        cli.close()
        relay.close()
        srv.close()
    # a fake server that does not hold the token: the client refuses it before any request
    lst = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def fake() -> None:
        from agentserve.kv.remote.frames import recv_header, send_frame

        conn, _ = lst.accept()
        with conn, lst:
            send_frame(conn, {"op": "hello", "v": 2, "nonce": b"n" * 32})
            recv_header(conn)
            send_frame(conn, {"ok": True, "mac": b"m" * 32})
            conn.settimeout(1)
            try:
                got.extend(conn.recv(1 << 16))
            except OSError:
                pass

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    with pytest.raises(TransferError, match="could not prove"):
        TcpBackend(token, timeout=5).pull_into(
            PullSpec("127.0.0.1", lst.getsockname()[1], "r", [0], [b""]), dk, dv, [0])
    t.join(5)
    assert b"pull" not in got  # no request went to it


def test_peers_outside_the_allow_list_are_never_connected() -> None:
    lst = socket.create_server(("127.0.0.1", 0))
    lst.settimeout(0.3)
    port = lst.getsockname()[1]
    cli = TcpBackend("t", peers=frozenset({("127.0.0.1", 1)}))
    k, v = cache(blocks=4)
    with pytest.raises(TransferError, match="--kv-transfer-peers"):
        cli.pull_into(PullSpec("127.0.0.1", port, "r", [0], [b""]), k, v, [0])
    cli.release("127.0.0.1", port, "r")  # (logged, not raised: its pins expire anyway)
    with pytest.raises(socket.timeout):
        lst.accept()  # nothing ever connected
    lst.close()


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_idle_unauthenticated_connections_are_capped_and_closed() -> None:
    """200 connections that never authenticate: at most max_conns get a thread, the rest a
    refusal at once; each thread ends by the auth timeout; then a real client is served."""
    from agentserve.kv.remote.frames import recv_header

    k, v = cache()
    # 2 s: opening 200 sockets on a loaded 2-core box can take longer than a shorter timeout,
    # and slots freed mid-loop would let later connections in instead of refusing them
    srv = TcpBackend("t", auth_timeout=2.0, max_conns=16)
    port = srv.serve(Source(k, v), "127.0.0.1", 0)
    socks = []
    try:
        for _ in range(200):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.2)
        assert _threads("kv-xfer-conn") <= 16
        refused = 0
        for s in socks[-50:]:
            head = recv_header(s)
            refused += head.get("ok") is False and "limit" in head.get("error", "")
        assert refused == 50
        deadline = time.monotonic() + 10
        while _threads("kv-xfer-conn") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _threads("kv-xfer-conn") == 0, "connections that never authenticated kept threads"
        assert time.monotonic() < deadline - 6  # (within about the auth timeout)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        TcpBackend("t", timeout=5).pull_into(PullSpec("127.0.0.1", port, "r", [1], [b""],
                                                      release=False), dk, dv, [7])
        assert torch.equal(dk[:, 7], k[:, 2])
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_a_drip_fed_handshake_is_cut_at_its_deadline() -> None:
    """A peer sending its auth frame a byte at a time (each within the socket timeout)
    still loses the connection at about the auth timeout."""
    from agentserve.kv.remote.frames import recv_header

    k, v = cache(blocks=4)
    srv = TcpBackend("t", auth_timeout=0.6)
    port = srv.serve(Source(k, v), "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            recv_header(c)
            t0 = time.monotonic()
            c.sendall(b"\0\0\0\x40")  # a 64-byte header follows... one byte at a time
            closed = False
            for _ in range(64):
                time.sleep(0.25)
                try:
                    c.sendall(b"\x80")
                    c.settimeout(0.01)
                    closed = c.recv(1) == b""
                except socket.timeout:
                    pass
                except OSError:
                    closed = True
                if closed:
                    break
            assert closed and time.monotonic() - t0 < 2.5
    finally:
        srv.close()


def test_an_idle_authenticated_connection_is_closed_and_the_client_reconnects() -> None:
    k, v = cache()
    srv = TcpBackend("t", idle_timeout=0.3)
    port = srv.serve(Source(k, v), "127.0.0.1", 0)
    cli = TcpBackend("t", timeout=5)
    try:
        spec = PullSpec("127.0.0.1", port, "r", [0], [b""], release=False)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        cli.pull_into(spec, dk, dv, [0])
        deadline = time.monotonic() + 5
        while _threads("kv-xfer-conn") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _threads("kv-xfer-conn") == 0  # the server let the idle connection go
        cli.pull_into(spec, dk, dv, [1])  # the pooled one is dead: retried on a fresh one
        assert torch.equal(dk[:, 1], k[:, 0])
    finally:
        cli.close()
        srv.close()
