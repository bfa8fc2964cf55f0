"""The TCP transfer backend alone: zero-copy and staged paths, chunking, reuse, faults."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from agentserve.engine.transfer_wire import (
    PullSpec,
    TcpBackend,
    TransferError,
    block_shape,
)
from agentserve.kv.transfer import StagingBuffer, block_views, gather_blocks


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


def cache(blocks: int = 40, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (3, blocks, 4, 2, 8)  # L, blocks, bs, H, D
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_pull_into_matches_gather(staged: bool, dtype: torch.dtype, chunk: int) -> None:
    k, v = cache(dtype=dtype)
    src = Source(k, v)
    srv = TcpBackend("t", staged=staged)
    port = srv.serve(src, "127.0.0.1", 0)
    cli = TcpBackend("t", chunk_blocks=chunk, staged=staged)
    try:
        dk, dv = torch.zeros(3, 30, 4, 2, 8, dtype=dtype), torch.zeros(3, 30, 4, 2, 8, dtype=dtype)
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
    from agentserve.engine.transfer_wire import recv_header, send_frame

    k, v = cache(blocks=4)
    lst = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = lst.accept()
        with conn, lst:
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
