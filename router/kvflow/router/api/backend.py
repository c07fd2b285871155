"""One pool behind the gateway, and everything that is its own: the tokenizer and chat
template, block index, sessions, workers, admission control, sampling defaults and length
limits. The gateway (api/gateway.py) holds one of these per pool, and what they share."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

from kvflow.proto import worker_pb2 as pb
from kvflow.router.config_fields import ConfigError
from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import no_worker_available
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.placement import DisaggregationConfig, build_placement
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.serving.admission_control import AdmissionControl, AdmittedGenerationService
from kvflow.router.serving.defaults import model_sampling_defaults
from kvflow.router.serving.executor import PlanExecutor
from kvflow.router.serving.generate import GenerationService
from kvflow.router.serving.prompts import PromptBuilder
from kvflow.router.serving.public_prefix import PublicPrefixes
from kvflow.router.serving.token_budget import TokenPolicy, model_max_tokens, token_policy
from kvflow.router.settings import RouterSettings
from kvflow.router.tenants.config import MaxTokensLimits, Tenant
from kvflow.router.text.generation_config import SamplingDefaults
from kvflow.router.text.model_files import TextModel, load_text_model
from kvflow.router.workers.book import LOAD_INTERVAL_S
from kvflow.router.workers.discovery import DnsWorkers, StaticWorkers, parse_address
from kvflow.router.workers.pool import WorkerPool
from kvflow.router.workers.tls import WorkerTls

log = logging.getLogger("kvflow.router")

# The pool a gateway without `pools:` builds from its command line.
DEFAULT_POOL = "default"


@dataclass(frozen=True)
class PoolSource:
    """Where a pool's model files and workers are: a `pools:` entry, or the command line."""

    name: str
    model: str | None  # tokenizer + chat template; None: the built-in SmolLM2 GGUF
    served_model_name: str | None  # None: whatever its workers report
    workers: tuple[str, ...]
    worker_dns: str | None
    disaggregation: DisaggregationConfig
    worker_tls: WorkerTls  # how to dial its workers (workers/tls.py)


@dataclass
class PoolBackend:
    name: str
    text: TextModel
    prompts: PromptBuilder
    index: BlockIndex
    sessions: SessionTable
    pool: WorkerPool
    service: GenerationService
    discovery: StaticWorkers | DnsWorkers
    configured_served_name: str | None = None
    # For the fields a request leaves out: the operator's over the model's own.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    max_tokens: MaxTokensLimits = field(default_factory=MaxTokensLimits)  # the model's
    # Sheds load (429/503) before the workers' queues make latency collapse; the service
    # consults it (serving/admission_control.py). None: no admission control.
    admission: AdmissionControl | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.discovery.run(self.pool.set_addresses)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close()

    def served_models(self) -> list[str]:
        """The names its workers answer to: the configured one, else what they report."""
        if self.configured_served_name is not None:
            return [self.configured_served_name]
        return sorted(self.pool.known_models())

    def served_name(self) -> str | None:
        """The one name this pool answers as (several reported: the first); None until a
        worker has reported it."""
        names = self.served_models()
        return names[0] if names else None

    def model_info(self, model: str, *, label: bool) -> pb.WorkerInfo:
        """A healthy worker's facts for ``model``; a 503 naming the pool (``label``) when
        none is up."""
        if not label:
            return self.service.model_info(model)
        info = self.pool.model_info(model)
        if info is None:
            raise no_worker_available(
                f"No healthy worker in pool '{self.name}' serves '{model}' right now "
                f"({self.pool.num_healthy()} of {len(self.pool)} workers healthy); retry shortly."
            )
        return info

    def token_policy(self, tenant: Tenant, model: str) -> TokenPolicy:
        return token_policy(
            self.max_tokens,
            tenant.max_tokens,
            model_name=model,
            tokens_per_minute=tenant.quotas.tokens_per_minute,
            tenant_name=tenant.name,
        )

    def max_model_len(self, worker_max_len: int) -> int:
        files_max_len = self.text.max_model_len
        return worker_max_len if files_max_len is None else min(worker_max_len, files_max_len)


def _public_prefixes(settings: RouterSettings, text: TextModel) -> PublicPrefixes:
    prefixes = []
    for spec in settings.config.public_prefixes:
        if spec.system is not None:
            if text.chat_template is None:
                raise ConfigError("public_prefixes: a system prefix needs a chat template")
            rendered = text.chat_template.render(
                [{"role": "system", "content": spec.system}], add_generation_prompt=False
            )
        else:
            assert spec.text is not None
            rendered = spec.text
        prefixes.append(text.tokenizer.encode(rendered, add_special_tokens=False))
    return PublicPrefixes(prefixes)


def build_backend(
    source: PoolSource,
    settings: RouterSettings,
    metrics: RouterMetrics,
    *,
    label: str = "",
    texts: dict[str | None, TextModel] | None = None,
) -> PoolBackend:
    """Load the pool's tokenizer and wire its components; nothing runs until `start()`.
    ``label`` prefixes its log lines ("pool NAME: ") when there are several; ``texts``:
    model files already loaded, by path, for pools that share them (read-only once built)."""
    texts = {} if texts is None else texts
    text = texts.get(source.model)
    if text is None:
        text = texts[source.model] = load_text_model(source.model)
        text.tokenizer.token_bytes(0)  # build the byte table now, not on the first request
    config = settings.config
    index = BlockIndex(config.max_blocks_per_worker)
    sessions = SessionTable()
    rng = random.Random(settings.seed)
    placement = build_placement(
        config.weights, source.disaggregation, index=index, sessions=sessions, rng=rng
    )
    # One Load poll serves routing and admission: as often as admission asks, if oftener.
    admission_s = settings.admission.poll_interval_s if settings.admission.is_enabled else None
    load_interval_s = min(LOAD_INTERVAL_S, admission_s or LOAD_INTERVAL_S)
    pool = WorkerPool(
        index, sessions, source.worker_tls, load_interval_s=load_interval_s, name=source.name,
        breaker=settings.breaker,
        on_circuit=lambda scope, _, was, to: metrics.circuits.count(source.name, scope, was, to),
    )  # fmt: skip
    admission = AdmissionControl(pool, settings.admission, metrics, source.name)
    service = AdmittedGenerationService(
        admission,
        pool,
        placement,
        PlanExecutor(pool, metrics, source.disaggregation, settings.deadlines),
        sessions,
        text.tokenizer,
        _public_prefixes(settings, text),
        metrics,
    )
    discovery: StaticWorkers | DnsWorkers
    if source.worker_dns:
        host, port = parse_address(source.worker_dns)
        discovery = DnsWorkers(host, port, settings.dns_interval_s)
    else:
        discovery = StaticWorkers(source.workers)
    defaults = model_sampling_defaults(
        text.sampling_defaults, config.sampling_defaults, use_files=config.use_generation_config
    )
    max_tokens = model_max_tokens(config.max_tokens, defaults.max_tokens)
    log.info(
        "%ssampling defaults for requests that leave them out: %s (model's from %s%s)",
        label,
        defaults.as_dict() or "none, OpenAI's",
        text.sampling_defaults_source,
        "" if config.use_generation_config else ", ignored: sampling.generation_config none",
    )
    return PoolBackend(
        name=source.name,
        text=text,
        prompts=PromptBuilder(text),
        index=index,
        sessions=sessions,
        pool=pool,
        service=service,
        discovery=discovery,
        configured_served_name=source.served_model_name,
        sampling_defaults=defaults,
        max_tokens=max_tokens,
        admission=admission,
    )
