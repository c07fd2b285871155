"""What TLS itself costs a socket here, apart from kvflow: one 512 MiB blast over loopback,
plaintext and mutual TLS 1.3 (Python's ssl, certificates made by openssl for the run), with
each side's CPU seconds per GiB (thread CPU time, which the machine's other load does not
inflate the way it inflates wall time). The bound the KV port's --kv-tls arm
(bench/kv_transfer.py --tls) runs against.

    python bench/kv_tls_socket_cpu.py [--mib 512] [--rounds 2]
"""

from __future__ import annotations

import argparse
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path


def contexts(d: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(d / "ca.pem"))
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(d / "ca.pem"))
    for context in (server, client):
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(str(d / "server.pem"), str(d / "server.key"))
    return server, client


def blast(num_bytes: int, tls: tuple[ssl.SSLContext, ssl.SSLContext] | None) -> dict[str, float]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received = memoryview(bytearray(num_bytes))
    recv_cpu: list[float] = []

    def receive() -> None:
        conn, _ = listener.accept()
        if tls is not None:
            conn = tls[0].wrap_socket(conn, server_side=True)
        started, got = time.thread_time(), 0
        while got < num_bytes:
            got += conn.recv_into(received[got:], min(num_bytes - got, 1 << 20))
        recv_cpu.append(time.thread_time() - started)
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    sock = socket.create_connection(("127.0.0.1", port))
    if tls is not None:
        sock = tls[1].wrap_socket(sock, server_hostname="127.0.0.1")
    data = memoryview(bytearray(num_bytes))
    cpu, wall = time.thread_time(), time.perf_counter()
    sock.sendall(data)
    send_cpu = time.thread_time() - cpu
    sock.recv(1)
    wall = time.perf_counter() - wall
    sock.close()
    thread.join()
    listener.close()
    gib = num_bytes / 2**30
    return {"gbps": num_bytes / wall / 1e9, "send_cpu_s_per_gib": send_cpu / gib,
            "recv_cpu_s_per_gib": recv_cpu[0] / gib}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from testkit.certs import make_certs

    with tempfile.TemporaryDirectory() as d:
        make_certs(Path(d))
        tls = contexts(Path(d))
        for _ in range(args.rounds):
            for name, arm in (("plaintext", None), ("tls", tls)):
                r = blast(args.mib << 20, arm)
                send, recv = r["send_cpu_s_per_gib"], r["recv_cpu_s_per_gib"]
                print(f"{name:9} {r['gbps']:.2f} GB/s; CPU s per GiB: send {send:.2f}, "
                      f"receive {recv:.2f}")  # fmt: skip
    print(ssl.OPENSSL_VERSION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
