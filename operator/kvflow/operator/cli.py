"""`kvflow operator`: reconcile InferencePools into workers, a gateway and status."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket

from kvflow.operator.admin_policy import AdminPolicy, setting_problems
from kvflow.operator.builders.names import IMAGE_UID, Images
from kvflow.operator.builders.network import MetricsScrapers
from kvflow.operator.kube import Kube, load_config
from kvflow.operator.run import OperatorConfig, run_operator
from kvflow.proto.cli_args import port_number

DEFAULT_WORKER_IMAGE = "ghcr.io/kvflow/worker:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/kvflow/router:0.1.0"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvflow operator", description=__doc__)
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        dest="namespaces",
        help="watch this namespace (repeatable); default: all namespaces",
    )
    p.add_argument("--worker-image", default=DEFAULT_WORKER_IMAGE, help="default worker image")
    p.add_argument("--router-image", default=DEFAULT_ROUTER_IMAGE, help="default router image")
    p.add_argument(
        "--run-as-user",
        type=run_as_user,
        default=IMAGE_UID,
        metavar="UID|none",
        help=f"the user (and group) worker and router pods run as (default: {IMAGE_UID}, the "
        "images'); none: the pods name no user and the platform assigns one, as OpenShift's "
        "restricted SCC does",
    )
    p.add_argument(
        "--drift-interval-seconds",
        type=float,
        default=30.0,
        help="how often every pool is re-applied to repair drift",
    )
    p.add_argument(
        "--liveness-port", type=port_number, default=8080, help="GET /healthz port (0: none)"
    )
    p.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hold a Lease so that only one replica acts (default: on)",
    )
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="namespace of the leader Lease (default: $POD_NAMESPACE or default)",
    )
    p.add_argument("--lease-name", default="kvflow-operator")
    p.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
        help="this replica's name in the Lease (default: $POD_NAME)",
    )
    p.add_argument(
        "--allowed-host-path-prefix",
        action="append",
        default=[],
        dest="allowed_host_path_prefixes",
        metavar="FOLDER",
        help="node folder under which a pool's model.volume.hostPath may lie (repeatable); "
        "default: none, every hostPath volume is refused",
    )
    p.add_argument(
        "--allowed-prometheus-url",
        action="append",
        default=[],
        dest="allowed_prometheus_urls",
        metavar="URL",
        help="base URL (scheme, host, port, path) of a Prometheus the planner may query for "
        "a pool's autoscaling.prometheus.url, that URL or below it (repeatable); default: "
        "none, the planner scrapes the pods itself",
    )
    p.add_argument(
        "--metrics-scraper-namespace",
        action="append",
        default=[],
        dest="metrics_scraper_namespaces",
        metavar="NAMESPACE",
        help="pods in this namespace (Prometheus') may reach the workers' and routers' "
        "metrics ports (repeatable; '*': pods in any namespace); the operator's own "
        "namespace ($POD_NAMESPACE) always may, for the planner's scrapes; default: no other",
    )
    p.add_argument("--kubeconfig", default=None, help="default: in-cluster, then $KUBECONFIG")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    problems = setting_problems(_policy(args))
    if problems:
        p.error("; ".join(problems))
    return args


def run_as_user(text: str) -> int | None:
    if text == "none":
        return None
    try:
        uid = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a user id or none: {text!r}") from None
    if uid < 1:  # pods never run as root
        raise argparse.ArgumentTypeError(f"a non-root user id (1 or more), got {uid}")
    return uid


def _policy(args: argparse.Namespace) -> AdminPolicy:
    return AdminPolicy(
        allowed_host_path_prefixes=tuple(args.allowed_host_path_prefixes),
        allowed_prometheus_urls=tuple(args.allowed_prometheus_urls),
        metrics_scrapers=metrics_scrapers(
            args.metrics_scraper_namespaces, os.environ.get("POD_NAMESPACE")
        ),
    )


def metrics_scrapers(named: list[str], own_namespace: str | None) -> MetricsScrapers:
    """The named namespaces ('*': any) and the operator's own, whose planner scrapes the
    pools' pods (unknown outside a cluster, where the planner reaches no pod IP anyway)."""
    namespaces = [n for n in named if n != "*"]
    if own_namespace:
        namespaces.insert(0, own_namespace)
    return MetricsScrapers(tuple(dict.fromkeys(namespaces)), any_namespace="*" in named)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # kopf logs every handler call at INFO; the operator's own log and Events say more.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    cfg = OperatorConfig(
        images=Images(
            worker=args.worker_image, router=args.router_image, run_as_uid=args.run_as_user
        ),
        namespaces=list(args.namespaces),
        drift_interval_s=args.drift_interval_seconds,
        liveness_port=args.liveness_port,
        leader_election=args.leader_election,
        lease_namespace=args.lease_namespace,
        lease_name=args.lease_name,
        identity=args.identity,
        policy=_policy(args),
    )
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's login reads the same file
    kube = Kube(load_config(args.kubeconfig))
    return asyncio.run(run_operator(cfg, kube))
