"""Vectored socket I/O over arrays of ``struct iovec``: the TCP transport's zero-copy path.

A transfer of scattered blocks is a quarter of a million 4 KiB runs per GiB. Python's
``sendmsg``/``recvmsg_into`` want one buffer object per run, and building 262,144
memoryviews costs about 0.45 s per GiB here, as long as the wire itself. So the runs stay a
numpy array of (address, length) pairs, the layout of ``struct iovec`` on 64-bit Linux, and
go to ``writev``/``readv`` through ctypes (which releases the GIL during the call), at most
IOV_MAX entries per call. The socket must be non-blocking: one ``step`` moves what the
kernel takes now and never waits, so a caller can hold the blocks' access lock around it.

A TLS socket (the KV port with mutual TLS, tcp_tls.py) cannot take iovecs: the bytes pass
through OpenSSL, which encrypts them into its own buffers anyway, so ``step_buffered``
walks the same array one entry (a chunk of it at most) per ``send``/``recv_into`` on a
memoryview over the cache's memory. Plaintext keeps the zero-copy ``step``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import ssl

import numpy as np

IOV_MAX = 1024  # Linux's limit on entries per readv/writev
_libc = ctypes.CDLL(None, use_errno=True)
_libc.readv.argtypes = _libc.writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.readv.restype = _libc.writev.restype = ctypes.c_ssize_t
_WOULD_BLOCK = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)
# TLS: at most this much per send/recv_into (a few 16 KiB records), and per step, so a step
# holds the blocks' access lock for about a millisecond of encryption.
TLS_CHUNK_BYTES = 256 * 1024
TLS_STEP_BYTES = 1024 * 1024
_TLS_WOULD_BLOCK = (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError)


class IoVecCursor:
    """How far vectored I/O has got through an iovec array. The array is consumed in
    place: a partly moved entry is shifted past the bytes already moved."""

    def __init__(self, iovecs: np.ndarray) -> None:
        assert iovecs.dtype == np.uint64 and iovecs.ndim == 2 and iovecs.shape[1] == 2
        self._iov = np.ascontiguousarray(iovecs)
        self._next = 0
        self.num_bytes = int(self._iov[:, 1].sum())
        self.num_done = 0

    @property
    def is_done(self) -> bool:
        return self._next >= len(self._iov)

    def step(self, fd: int, *, write: bool, max_bytes: int | None = None) -> int:
        """One readv/writev on the non-blocking ``fd``: bytes moved, 0 when the socket is
        not ready. Raises ConnectionError when the peer closed it, OSError on an error."""
        window = self._iov[self._next : self._next + IOV_MAX]
        if max_bytes is not None:  # a prefix of the window, its last entry cut short
            ends = np.cumsum(window[:, 1])
            count = min(len(window), int(np.searchsorted(ends, max_bytes)) + 1)
            window = window[:count].copy()
            window[-1, 1] -= np.uint64(max(0, int(ends[count - 1]) - max_bytes))
        address = window.ctypes.data
        call = _libc.writev if write else _libc.readv
        moved = int(call(fd, address, len(window)))
        if moved < 0:
            code = ctypes.get_errno()
            if code in _WOULD_BLOCK:
                return 0
            raise OSError(code, os.strerror(code))
        if moved == 0:
            raise ConnectionError("the peer closed the KV stream early")
        self._advance(moved)
        return moved

    def step_buffered(
        self, sock: ssl.SSLSocket, *, write: bool, max_bytes: int | None = None
    ) -> int:
        """``step`` over a non-blocking TLS socket: ``send``/``recv_into`` entry by entry
        until it would block or TLS_STEP_BYTES moved. A TLS write that would block has
        taken part of its buffer and must be offered the same bytes again: the cursor
        stays put, and the next step offers exactly them (its limits are the same)."""
        moved_total = 0
        while not self.is_done and moved_total < TLS_STEP_BYTES:
            address, length = (int(x) for x in self._iov[self._next])
            size = min(length, TLS_CHUNK_BYTES)
            if max_bytes is not None:
                size = min(size, max_bytes - moved_total)
                if size <= 0:
                    break
            view = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
            try:
                moved = sock.send(view) if write else sock.recv_into(view, size)
            except _TLS_WOULD_BLOCK:
                break
            if moved == 0:
                raise ConnectionError("the peer closed the KV stream early")
            self.num_done += moved
            if moved == length:
                self._next += 1
            else:
                self._iov[self._next, 0] += np.uint64(moved)
                self._iov[self._next, 1] -= np.uint64(moved)
            moved_total += moved
        return moved_total

    def _advance(self, num_bytes: int) -> None:
        self.num_done += num_bytes
        window = self._iov[self._next : self._next + IOV_MAX, 1]
        ends = np.cumsum(window)
        num_whole = int(np.searchsorted(ends, num_bytes, side="right"))
        rest = num_bytes - (int(ends[num_whole - 1]) if num_whole else 0)
        self._next += num_whole
        if rest:
            self._iov[self._next, 0] += np.uint64(rest)
            self._iov[self._next, 1] -= np.uint64(rest)
