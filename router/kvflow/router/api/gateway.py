"""Everything one gateway process holds, assembled from its settings (state on app.state)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from redis.asyncio import Redis

from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import (
    invalid_api_key,
    model_not_allowed,
    model_not_found,
    no_worker_available,
)
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.placement import build_placement
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.serving.admission_control import AdmissionControl, AdmittedGenerationService
from kvflow.router.serving.defaults import model_sampling_defaults
from kvflow.router.serving.executor import PlanExecutor
from kvflow.router.serving.generate import GenerationService
from kvflow.router.serving.prompts import PromptBuilder
from kvflow.router.serving.public_prefix import PublicPrefixes
from kvflow.router.serving.token_budget import TokenPolicy, token_policy
from kvflow.router.settings import ConfigError, RouterSettings
from kvflow.router.tenants.config import ANONYMOUS, MaxTokensLimits, Tenant, parse_tenants
from kvflow.router.tenants.redis_store import RedisQuotaStore
from kvflow.router.tenants.service import QuotaService
from kvflow.router.tenants.source import TenantSource, key_secret_from_env
from kvflow.router.text.generation_config import SamplingDefaults
from kvflow.router.text.model_files import TextModel, load_text_model
from kvflow.router.workers.discovery import DnsWorkers, StaticWorkers, parse_address
from kvflow.router.workers.pool import WorkerPool

log = logging.getLogger("kvflow.router")

# Redis calls sit on the request path: a stalled Redis must cost a request at most this
# much before the in-process fallback takes over.
REDIS_TIMEOUT_S = 0.5


def _mask(api_key: str) -> str:
    return api_key[:3] + "***" + api_key[-2:] if len(api_key) > 8 else "***"


@dataclass
class Gateway:
    settings: RouterSettings
    text: TextModel
    prompts: PromptBuilder
    index: BlockIndex
    sessions: SessionTable
    pool: WorkerPool
    service: GenerationService
    quotas: QuotaService
    metrics: RouterMetrics
    redis: Redis | None
    discovery: StaticWorkers | DnsWorkers
    # For the fields a request leaves out: the operator's over the model's own.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    max_tokens: MaxTokensLimits = field(default_factory=MaxTokensLimits)  # the model's
    # Sheds load (429/503) before the workers' queues make latency collapse; the service
    # consults it (serving/admission_control.py). None: no admission control.
    admission: AdmissionControl | None = None
    # The tenants in force (the config's, or a file's, re-read when it changes).
    tenants: TenantSource = field(
        default_factory=lambda: TenantSource(parse_tenants(None), None, None)
    )
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def session_header(self) -> str:
        return self.settings.config.session_header

    async def start(self) -> None:
        self.quotas.start()
        if self.admission is not None:
            self.admission.start()
        self._tasks.append(asyncio.create_task(self.discovery.run(self.pool.set_addresses)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.admission is not None:
            await self.admission.stop()
        await self.quotas.stop()
        await self.pool.close()
        if self.redis is not None:
            await self.redis.aclose()

    def served_models(self) -> list[str]:
        if self.settings.served_model_name is not None:
            return [self.settings.served_model_name]
        return sorted(self.pool.known_models())

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        tenants = self.tenants.current
        if tenants.is_open:
            return ANONYMOUS
        authorization = headers.get("authorization", "")
        scheme, _, api_key = authorization.partition(" ")
        api_key = api_key.strip()
        if scheme.lower() != "bearer" or not api_key:
            raise invalid_api_key(
                "You didn't provide an API key. Provide it in an Authorization header using "
                "Bearer auth (Authorization: Bearer YOUR_KEY)."
            )
        tenant = tenants.lookup(api_key)
        if tenant is None:
            raise invalid_api_key(f"Incorrect API key provided: {_mask(api_key)}.")
        return tenant

    def check_model(self, model: str, tenant: Tenant) -> None:
        """404 for a model nobody serves, 403 for one this tenant may not use."""
        served = self.served_models()
        if not served:  # no --served-model-name, and no worker has answered yet
            raise no_worker_available(
                f"No worker has reported its model yet ({len(self.pool)} known); retry shortly."
            )
        if model not in served:
            raise model_not_found(model, [m for m in served if tenant.may_use(m)])
        if not tenant.may_use(model):
            raise model_not_allowed(model)

    def token_policy(self, tenant: Tenant, model: str) -> TokenPolicy:
        return token_policy(self.max_tokens, tenant.max_tokens, model_name=model,
                            tokens_per_minute=tenant.quotas.tokens_per_minute,
                            tenant_name=tenant.name)  # fmt: skip

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


def build_gateway(settings: RouterSettings) -> Gateway:
    """Load the tokenizer and wire the components; nothing runs until `start()`."""
    text = load_text_model(settings.model)
    text.tokenizer.token_bytes(0)  # build the byte table now, not on the first request
    config = settings.config
    metrics = RouterMetrics()
    index = BlockIndex(config.max_blocks_per_worker)
    sessions = SessionTable()
    rng = random.Random(settings.seed)
    placement = build_placement(
        config.weights, config.disaggregation, index=index, sessions=sessions, rng=rng
    )
    pool = WorkerPool(index, sessions)
    admission = AdmissionControl(pool, settings.admission, metrics)
    service = AdmittedGenerationService(
        admission,
        pool,
        placement,
        PlanExecutor(pool, metrics, config.disaggregation, settings.deadlines),
        sessions,
        text.tokenizer,
        _public_prefixes(settings, text),
        metrics,
    )
    redis = None
    if settings.redis_url:
        redis = Redis.from_url(
            settings.redis_url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
        )
    quotas = QuotaService(RedisQuotaStore(redis) if redis is not None else None)
    discovery: StaticWorkers | DnsWorkers
    if settings.worker_dns:
        host, port = parse_address(settings.worker_dns)
        discovery = DnsWorkers(host, port, settings.dns_interval_s)
    else:
        discovery = StaticWorkers(settings.workers)
    metrics.watch(pool.num_healthy, lambda: len(pool), lambda: len(index))
    defaults = model_sampling_defaults(
        text.sampling_defaults, config.sampling_defaults, use_files=config.use_generation_config
    )
    # A length default from the model's files (max_new_tokens) yields to the operator's.
    max_tokens = config.max_tokens
    if max_tokens.default_max_tokens is None and defaults.max_tokens is not None:
        limit = max_tokens.max_tokens_limit
        default = defaults.max_tokens if limit is None else min(defaults.max_tokens, limit)
        max_tokens = MaxTokensLimits(default, limit)
    log.info(
        "sampling defaults for requests that leave them out: %s (model's from %s%s)",
        defaults.as_dict() or "none, OpenAI's",
        text.sampling_defaults_source,
        "" if config.use_generation_config else ", ignored: sampling.generation_config none",
    )
    tenants = TenantSource(config.tenants, settings.tenants_file, key_secret_from_env())
    if tenants.current.is_open:
        log.warning("no tenants configured: the gateway accepts any API key (one shared cache)")
    return Gateway(
        settings=settings,
        text=text,
        prompts=PromptBuilder(text),
        index=index,
        sessions=sessions,
        pool=pool,
        service=service,
        quotas=quotas,
        metrics=metrics,
        redis=redis,
        discovery=discovery,
        sampling_defaults=defaults,
        max_tokens=max_tokens,
        admission=admission,
        tenants=tenants,
    )
