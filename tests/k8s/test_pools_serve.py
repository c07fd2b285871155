"""The operator's output actually serves.

The sample pools are applied to the real API server; once the operator has made them
Ready, the containers of the pods it caused to exist are started as local processes,
from their command, args and env as the API server holds them (`pod_processes`), and real
requests go through each pool's own gateway with the official `openai` client. KWOK alone
marks pods Ready without running them: that is how a disaggregated pool that answered 503
to every request once passed as Ready.

Workers are real `kvflow worker` processes serving the built-in SmolLM2-135M-Instruct
(about 1 GB each); the two pools run four of them and two routers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
import yaml
from k8s.controlplane import REPO, ControlPlane
from k8s.operator_process import OperatorProcess
from k8s.pod_processes import LoopbackNetwork
from k8s.served_pools import RunningPool, run_pool
from k8s.support import wait_for
from testkit.certs import make_certs

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.router.tenants.config import hmac_api_key

pytestmark = pytest.mark.slow

COLOCATED_SAMPLE = REPO / "samples" / "cpu-smollm2.yaml"
DISAGGREGATED_SAMPLE = REPO / "samples" / "cpu-smollm2-disaggregated.yaml"
WORKER_TOKEN = "t0ken-of-the-disaggregated-pool"
# The disaggregated pool's gateway has one tenant, from the user's Secret, its key kept as
# an HMAC digest under a second Secret key (router.tenantsSecret, router.tenantKeySecret).
TENANT_API_KEY = "sk-lighthouse-0123456789"
TENANT_HMAC_SECRET = "hmac-secret-of-the-disaggregated-pool"
ROUTE_HEADER = "x-kvflow-route"

# Several hundred tokens, well above the disaggregated sample's minRemotePrefillTokens:
# the decode worker holds none of it, so the router should hand it to the prefill worker.
PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "brass lantern and a notebook in which she recorded the wind, the height of the waves "
    "and the names of the ships that passed the rocks below the tower. "
)
LONG_PROMPT = (
    "".join(f"Day {day}. {PARAGRAPH}" for day in range(1, 17))
    + "On the last day of the year, the lighthouse keeper"
)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def serving_operator(
    cluster: ControlPlane, operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    proc = OperatorProcess(
        cluster, operator_kubeconfig, tmp_path_factory.mktemp("serve-operator"), "op-serve"
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def network() -> LoopbackNetwork:
    return LoopbackNetwork()


@contextmanager
def _served(
    cluster: ControlPlane,
    namespace: str,
    sample: Path,
    network: LoopbackNetwork,
    workdir: Path,
    worker_token: str | None = None,
    tenant_api_key: str | None = None,
    worker_tls: Path | None = None,
) -> Iterator[RunningPool]:
    cluster.kubectl("create", "namespace", namespace)
    wait_for(  # pods are refused until the namespace's default ServiceAccount exists
        lambda: (
            cluster.kubectl("get", "sa", "default", "-n", namespace, check=False).returncode == 0
        ),
        60,
        f"namespace {namespace}'s default ServiceAccount",
    )
    overrides = None
    if worker_tls is not None:  # what a cert-manager Certificate would hold (certs below)
        certs = worker_tls
        cluster.kubectl("create", "secret", "generic", "pool-tls", "-n", namespace,
                        f"--from-file=tls.crt={certs / 'server.pem'}",
                        f"--from-file=tls.key={certs / 'server.key'}",
                        f"--from-file=ca.crt={certs / 'ca.pem'}")  # fmt: skip
        overrides = {"workerTls": {"secretName": "pool-tls"}}
    if worker_token is not None:  # the user's Secret, named in spec.workerTokenSecret
        cluster.kubectl("create", "secret", "generic", "pool-token", "-n", namespace,
                        f"--from-literal=token={worker_token}")  # fmt: skip
        token_ref = {"name": "pool-token", "key": "token"}
        overrides = {**(overrides or {}), "workerTokenSecret": token_ref}
    if tenant_api_key is not None:  # the user's tenants Secret
        digest = hmac_api_key(tenant_api_key, TENANT_HMAC_SECRET.encode())
        tenants = (  # admin: the test reads the route explanations (x-kvflow-route)
            f"tenants:\n- name: lighthouse\n  api_key_hmac_sha256: [{digest}]\n  admin: true\n"
        )
        cluster.kubectl("create", "secret", "generic", "pool-tenants", "-n", namespace,
                        f"--from-literal=tenants.yaml={tenants}",
                        f"--from-literal=hmac={TENANT_HMAC_SECRET}")  # fmt: skip
        overrides = {
            **(overrides or {}),
            "router": {
                "tenantsSecret": {"name": "pool-tenants", "key": "tenants.yaml"},
                "tenantKeySecret": {"name": "pool-tenants", "key": "hmac"},
            },
        }
    try:
        with run_pool(cluster, namespace, sample, network, workdir, overrides) as pool:
            yield pool
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


COLOCATED_NAMESPACE = "t-serve-colocated"


@pytest.fixture(scope="module")
def colocated_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The colocated pool's worker TLS: a certificate for <pool>-workers.<namespace>.svc."""
    docs = yaml.safe_load_all(COLOCATED_SAMPLE.read_text())
    pool_name = next(d for d in docs if d["kind"] == "InferencePool")["metadata"]["name"]
    certs = tmp_path_factory.mktemp("colocated-tls")
    make_certs(certs, f"{pool_name}-workers.{COLOCATED_NAMESPACE}.svc")
    return certs


@pytest.fixture(scope="module")
def colocated(
    cluster: ControlPlane,
    serving_operator: OperatorProcess,
    network: LoopbackNetwork,
    tmp_path_factory: pytest.TempPathFactory,
    colocated_certs: Path,
) -> Iterator[RunningPool]:
    workdir = tmp_path_factory.mktemp("colocated-pods")
    # No worker token given: the workers and the router use the one the operator generated.
    # Worker gRPC over mutual TLS (spec.workerTls): the router dials its workers with it.
    with _served(cluster, COLOCATED_NAMESPACE, COLOCATED_SAMPLE, network, workdir,
                 tenant_api_key=TENANT_API_KEY, worker_tls=colocated_certs) as pool:  # fmt: skip
        yield pool


@pytest.fixture(scope="module")
def disaggregated(
    cluster: ControlPlane,
    serving_operator: OperatorProcess,
    network: LoopbackNetwork,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningPool]:
    workdir = tmp_path_factory.mktemp("disaggregated-pods")
    # With a worker token: prefill and decode workers then serve only the pool's router.
    with _served(cluster, "t-serve-disaggregated", DISAGGREGATED_SAMPLE, network, workdir,
                 worker_token=WORKER_TOKEN, tenant_api_key=TENANT_API_KEY) as pool:  # fmt: skip
        yield pool


@dataclass(frozen=True)
class Answer:
    text: str
    route: str  # the x-kvflow-route header: the worker(s) that served the request
    num_prompt_tokens: int


def complete(pool: RunningPool, prompt: str, api_key: str = TENANT_API_KEY) -> Answer:
    """A greedy completion through the pool's gateway, asking for the route header."""
    client = openai.OpenAI(
        base_url=f"{pool.gateway_url}/v1", api_key=api_key, max_retries=0, timeout=180
    )
    raw = client.completions.with_raw_response.create(
        model=pool.spec["model"]["servedName"],
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={ROUTE_HEADER: "1"},
    )
    completion = raw.parse()
    assert completion.usage is not None
    return Answer(
        completion.choices[0].text,
        raw.headers.get(ROUTE_HEADER, ""),
        completion.usage.prompt_tokens,
    )


def test_colocated_sample_serves(colocated: RunningPool, colocated_certs: Path) -> None:
    workers = colocated.grpc_addresses("colocated")
    assert len(workers) == colocated.spec["colocated"]["replicas"]

    answer = complete(colocated, "The capital of France is")
    assert "Paris" in answer.text
    assert any(w in answer.route for w in workers), answer.route

    client = openai.OpenAI(base_url=f"{colocated.gateway_url}/v1", api_key=TENANT_API_KEY)
    chat = client.chat.completions.create(
        model=colocated.spec["model"]["servedName"],
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert "Paris" in (chat.choices[0].message.content or "")

    # spec.workerTls: the workers speak only TLS, to callers with a certificate their CA
    # signed (the router above presented one) ...
    certs = colocated_certs
    for address in workers:
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # ... and with one, no workerTokenSecret: the operator generated the pool's token, and
    # the workers refuse callers that do not present it.
    credentials = grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(),
        (certs / "client.key").read_bytes(),
        (certs / "client.pem").read_bytes(),
    )
    server_name = f"{colocated.name}-workers.{colocated.namespace}.svc"
    options = [("grpc.ssl_target_name_override", server_name)]
    for address in workers:
        with (
            grpc.secure_channel(address, credentials, options) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_disaggregated_sample_serves_like_the_colocated_one(
    colocated: RunningPool, disaggregated: RunningPool
) -> None:
    (prefill,) = disaggregated.grpc_addresses("prefill")
    (decode,) = disaggregated.grpc_addresses("decode")
    threshold = disaggregated.spec["router"]["disaggregation"]["minRemotePrefillTokens"]

    # A short prompt stays on the decode worker: shipping its KV would cost more than
    # computing it there.
    short = complete(disaggregated, "The capital of France is", TENANT_API_KEY)
    assert "Paris" in short.text
    assert decode in short.route and prefill not in short.route, short.route

    # A long one is prefilled by the prefill worker, its KV blocks move to the decode
    # worker, which generates: greedy text equal to the colocated pool's.
    reference = complete(colocated, LONG_PROMPT)
    answer = complete(disaggregated, LONG_PROMPT, TENANT_API_KEY)
    assert answer.num_prompt_tokens >= threshold + 200, answer.num_prompt_tokens
    assert prefill in answer.route and decode in answer.route, (
        f"{ROUTE_HEADER}: {answer.route!r} should name prefill {prefill} and decode {decode}"
    )
    assert answer.text == reference.text

    # The pool has a worker token (spec.workerTokenSecret): its workers refuse callers
    # that do not present it, so what served above was the operator's wiring of the token.
    for address in (prefill, decode):
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # Its gateway serves only the tenant of the user's Secret (router.tenantsSecret).
    for wrong in ("unused", TENANT_HMAC_SECRET):
        with pytest.raises(openai.AuthenticationError):
            complete(disaggregated, "The capital of France is", wrong)
