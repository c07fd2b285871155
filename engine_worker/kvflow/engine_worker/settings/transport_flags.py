"""`kvflow worker`'s KV transport flags: how KV blocks move between prefill and decode
workers, to whom, and under which TLS."""

from __future__ import annotations

import argparse

from kvflow.engine_worker.settings.record import WorkerSettings
from kvflow.engine_worker.tls import KV_TLS_MODES
from kvflow.proto.cli_args import port_number, seconds
from kvflow.proto.transports import KV_TRANSPORT_CHOICES


def add_transport_flags(p: argparse.ArgumentParser, d: WorkerSettings) -> None:
    p.add_argument(
        "--kv-transport",
        choices=KV_TRANSPORT_CHOICES,
        default=d.kv_transport,
        help="how KV blocks move between prefill and decode workers (auto: nccl on CUDA, "
        "tcp on CPU); every worker of a pool must use the same",
    )
    p.add_argument(
        "--kv-port",
        type=port_number,
        default=d.kv_port,
        help="port of the KV receiver / rendezvous store (0: any free port)",
    )
    p.add_argument(
        "--advertise-host",
        help="address other workers reach this one at for KV (default: --host, or this "
        "machine's address when --host is 0.0.0.0; in a pod, its IP)",
    )
    p.add_argument(
        "--max-kv-transfer-timeout-s",
        type=seconds(allow_zero=False),
        default=d.max_kv_transfer_timeout_s,
        help="the longest a KV transfer may take, whatever the router asks",
    )
    p.add_argument(
        "--kv-peer-allow",
        metavar="CIDRS",
        default=d.kv_peer_allow,
        help="networks this worker sends KV to, comma-separated CIDRs or addresses, e.g. "
        "the pod network 10.244.0.0/16: a reservation naming an endpoint elsewhere is "
        "refused before any connection (default: any endpoint)",
    )
    p.add_argument(
        "--kv-tls",
        choices=KV_TLS_MODES,
        default="auto",
        help="mutual TLS on the TCP KV port from the --tls-* files (auto: when "
        "--tls-ca-file is given; off: KV plaintext, for a trusted network where TLS's cost "
        "on KV throughput matters more; the worker token still proves both ends)",
    )
    p.add_argument(
        "--kv-tls-server-name",
        metavar="NAME",
        help="the name KV receivers' certificates carry, e.g. <pool>-workers.<ns>.svc "
        "(default: the address dialled)",
    )
