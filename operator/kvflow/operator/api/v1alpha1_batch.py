"""The router's Batch API storage and limits in the RouterSpec, version v1alpha1
(docs/router.md, "Batch API").

Split from ``v1alpha1_router`` (whose RouterSpec embeds it) to keep each file one concept.
The router keeps batch files and batches in its Redis when it has one, else in a folder
(--batch-dir), else the Batch API is off; the operator mounts the volume named here and
renders the --batch* flags (builders/router_features.py), each only when it differs from
the router's default, which the defaults here repeat. The rules that need the router's
Redis and replica count live on RouterSpec (BATCH_RULES). Pure: imports neither kopf nor
kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import CelRule, cel, field

# The router's defaults (kvflow.router.batch.config).
ROUTER_MAX_FILE_BYTES = 64 * 1024 * 1024
ROUTER_MAX_LINES = 50_000
ROUTER_MAX_IN_FLIGHT = 4
ROUTER_COMPLETION_WINDOW_S = 24 * 3600.0
ROUTER_PRICE_FACTOR = "0.5"
ROUTER_TPOT_HEADROOM_FRACTION = 0.3

BatchStorage = Literal["Redis", "Volume"]


@dataclass(frozen=True)
class BatchClaim:
    """A PersistentVolumeClaim in the router's namespace that holds the batches."""

    claim_name: str = field("Name of the claim.", min_length=1, max_length=253)


@cel(
    CelRule(
        "!has(self.storage) || self.storage != 'Volume' || has(self.persistentVolumeClaim)",
        "router.batch.storage Volume needs router.batch.persistentVolumeClaim",
        ".persistentVolumeClaim",
    ),
    CelRule(
        "!has(self.persistentVolumeClaim) || (has(self.storage) && self.storage == 'Volume')",
        "router.batch.persistentVolumeClaim is used with storage Volume only",
        ".persistentVolumeClaim",
    ),
)
@dataclass(frozen=True)
class BatchSpec:
    """The OpenAI Batch API (/v1/files, /v1/batches): uploaded JSONL files of requests run
    in the gateway's spare capacity, at priceFactor of their price."""

    storage: BatchStorage | None = field(
        """Where files and batches live. Redis: in router.redis (required), shared by every
        router replica. Volume: on persistentVolumeClaim, for a single router replica
        without router.redis. Unset: in router.redis when it is set, else the Batch API is
        off (404 with a message).""",
        None,
    )
    persistent_volume_claim: BatchClaim | None = field(
        "The claim mounted read-write into the router pod (storage Volume).", None
    )
    max_file_bytes: int = field(
        "The largest upload, in bytes; larger is a 413.",
        ROUTER_MAX_FILE_BYTES,
        minimum=1,
        maximum=1 << 40,
    )
    max_lines: int = field(
        "The most requests in one batch.", ROUTER_MAX_LINES, minimum=1, maximum=100_000_000
    )
    max_in_flight: int = field(
        "Batch requests each router replica runs at once, in spare capacity only.",
        ROUTER_MAX_IN_FLIGHT,
        minimum=1,
        maximum=100_000,
    )
    completion_window_seconds: float = field(
        'How long the "24h" completion window lasts (shorter for drills).',
        ROUTER_COMPLETION_WINDOW_S,
        minimum=0,
        exclusive_minimum=True,
        maximum=30 * 86400,
    )
    price_factor: str = field(
        """A batch request costs its price times this, a decimal from 0 to 1 (0.5: half
        price).""",
        ROUTER_PRICE_FACTOR,
        pattern=r"^(0(\.[0-9]{1,6})?|1(\.0{1,6})?)$",
    )
    online_tpot_target_ms: int | None = field(
        """The online TPOT target that paces batch requests: one starts only while every
        worker's decode step with it added stays within tpotHeadroomFraction of this. Unset:
        a pool's router takes its pool's slo.tpotTargetMs; a gateway's router, which serves
        several pools, paces by queues only.""",
        None,
        minimum=1,
        maximum=60000,
    )
    tpot_headroom_fraction: float = field(
        """The share of the online TPOT target a decode step may reach with a batch request
        added: about 1 - 2 x the share of a worker's time the online prompts take at the
        peak (docs/router.md, "Batch API").""",
        ROUTER_TPOT_HEADROOM_FRACTION,
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
    )
