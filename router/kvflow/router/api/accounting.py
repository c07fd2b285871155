"""Per-request usage: summed over choices, settled with quotas and metrics exactly once,
and logged as one line per request.

The line (logger ``kvflow.router.requests``, INFO) carries what an operator greps for: the
request id, tenant, model (and the pool that answered, with several), token counts, the
spend at the configured prices (``spend_usd``, exact: tenants/money.py), finish reasons,
TTFT and end-to-end time, and the attempts the router made. Never prompt or completion text:
they can hold anything a user typed, and logs are kept and shipped with far less care than
the requests themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from kvflow.router.api.gateway import Gateway
from kvflow.router.degrade.service import RequestDegradation
from kvflow.router.limits.service import LevelLease
from kvflow.router.protocol.responses import ChoiceDelta, UsageCounts
from kvflow.router.serving.types import ChoiceUsage, RequestTrace
from kvflow.router.tenants.config import Tenant
from kvflow.router.tenants.money import FREE, PICO_USD_PER_USD, discounted_pusd, spend_pusd
from kvflow.router.tenants.service import Lease
from kvflow.router.tenants.store import UsageTotals

log = logging.getLogger("kvflow.router.requests")


@dataclass
class Accounting:
    """Sums usage over choices and settles the request's quota lease exactly once."""

    gateway: Gateway
    tenant: Tenant
    lease: Lease
    trace: RequestTrace
    model: str = ""  # as the client asked for it
    num_choices: int = 1
    pool: str | None = None  # the pool that answered, when the gateway has several
    # The answering pool's served name (the response's `model`): the latency label, bounded
    # by the pools, where `model` is whatever the client sent.
    served_model: str = ""
    priority_class: str = "normal"  # the class it ran as (protocol/priority_class.py)
    # Called once when the request ends (the tenant's in-flight count, serving/tenant_gate.py).
    on_finish: Callable[[], None] | None = None
    # Its model's degradation ladder, fed this request's timings (degrade/service.py).
    degradation: RequestDegradation | None = None
    # The request's hold on the model, client-IP and global limits (limits/service.py).
    level_lease: LevelLease | None = None
    # An earlier call's usage for the same client request (a cascade's small model,
    # api/cascade.py), settled on its own: in the response's usage, never charged here.
    prior_usage: UsageCounts = field(default_factory=UsageCounts)
    # A cascade's outcome, as its x-kvflow-cascade header says it (both calls' lines).
    cascade: str | None = None
    # What its price is multiplied by: a Batch API line's discount (batch/config.py).
    price_factor: Fraction = Fraction(1)
    _prompt: dict[int, UsageCounts] = field(default_factory=dict)
    completion_tokens: int = 0
    # Choice index -> the completion tokens its deltas counted so far, and the choices whose
    # final usage came: a request cut short (the client left, a worker broke mid-stream) is
    # charged for its unsettled choices from these (charge_unsettled).
    _received_tokens: dict[int, int] = field(default_factory=dict)
    _settled_choices: set[int] = field(default_factory=set)
    _unsettled: UsageCounts = field(default_factory=UsageCounts)
    # Choice index -> why it ended, as the client was told (tool_calls included).
    finish_reasons: dict[int, str] = field(default_factory=dict)
    _is_finished: bool = False
    is_client_gone: bool = False  # the client left before the answer was complete
    # A response-cache hit (caches/): the stored answer is replayed and nothing generated,
    # so its completion tokens are shown to the caller but neither billed nor counted; its
    # prompt tokens are, all of them as cached.
    is_replayed: bool = False
    # The log line's `endpoint` when not a completion ("embeddings": api/embeddings.py).
    endpoint: str | None = None

    def add(self, item: ChoiceDelta | ChoiceUsage) -> None:
        if isinstance(item, ChoiceDelta):
            if item.finish_reason is not None:
                self.finish_reasons[item.index] = item.finish_reason
            received = self._received_tokens.get(item.index, 0)
            self._received_tokens[item.index] = max(received, item.num_completion_tokens)
            return
        self._settled_choices.add(item.index)
        # OpenAI counts a prompt once however many choices it has.
        seen = self._prompt.setdefault(item.prompt_index, UsageCounts())
        seen.prompt_tokens = max(seen.prompt_tokens, item.usage.prompt_tokens)
        seen.cached_tokens = max(seen.cached_tokens, item.usage.cached_tokens)
        self.completion_tokens += item.usage.completion_tokens

    def charge_unsettled(self, prompt_tokens: Sequence[int]) -> None:
        """The request ended before some choices' final usage came (the client left, or a
        worker broke mid-stream): charge those choices what their workers computed, as
        vLLM and OpenAI bill a request cut short. ``prompt_tokens``: each prompt's tokens,
        as prepared. A settled choice keeps its final usage; a replayed answer computed
        nothing. Idempotent: the latest call's estimate counts."""
        if self.is_replayed:
            return
        # A non-streamed choice's tokens wait in its buffer (serving/generate.py), unseen
        # here until it ends: the trace says how many it holds.
        received = dict(self._received_tokens)
        for index, num_tokens in self.trace.buffered_tokens.items():
            received[index] = max(received.get(index, 0), num_tokens)
        self._unsettled = unsettled_usage(
            prompt_tokens,
            received,
            self._settled_choices,
            settled_prompts=self._prompt.keys(),
            is_prefilled=self.trace.first_token_s is not None,
            num_choices=self.num_choices,
        )

    @property
    def usage(self) -> UsageCounts:
        """What the response reports: this call's usage and any earlier call's."""
        usage = self.own_usage
        usage.add(self.prior_usage)
        return usage

    @property
    def own_usage(self) -> UsageCounts:
        """This call's usage: what it is charged for (the final usage its choices reported,
        and what any cut short computed)."""
        usage = UsageCounts(
            prompt_tokens=sum(u.prompt_tokens for u in self._prompt.values()),
            completion_tokens=self.completion_tokens,
            cached_tokens=sum(u.cached_tokens for u in self._prompt.values()),
        )
        usage.add(self._unsettled)
        return usage

    def spend_pusd(self, usage: UsageCounts) -> int:
        """What this request costs at its served model's prices (pico-USD)."""
        prices = self.gateway.settings.config.prices.get(self.served_model, FREE)
        full = spend_pusd(
            prices,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
        )
        return discounted_pusd(full, self.price_factor)

    async def finish(self) -> None:
        if self._is_finished:
            return
        self._is_finished = True
        if self.on_finish is not None:
            self.on_finish()
        usage = self.own_usage
        if self.is_replayed:
            usage = UsageCounts(usage.prompt_tokens, 0, usage.cached_tokens)
        if self.level_lease is not None:  # released at once, settled in the background
            used_tokens = usage.prompt_tokens + usage.completion_tokens
            self.gateway.limits.release(self.level_lease, used_tokens)
        name, metrics = self.tenant.name, self.gateway.metrics
        metrics.tenant_requests.labels(name).inc()
        metrics.class_requests.labels(self.priority_class).inc()
        metrics.tenant_prompt_tokens.labels(name).inc(usage.prompt_tokens)
        metrics.tenant_completion_tokens.labels(name).inc(usage.completion_tokens)
        metrics.tenant_cached_tokens.labels(name).inc(usage.cached_tokens)
        spend = self.spend_pusd(usage)
        if spend:
            metrics.tenant_spend_usd.labels(name, self.served_model).inc(spend / PICO_USD_PER_USD)
        finished_s = time.perf_counter()
        if not self.is_replayed:  # the model's latency: a replay's is the cache's
            metrics.e2e_s.labels(self.served_model).observe(finished_s - self.trace.arrival_s)
        first_token_s = self.trace.first_token_s
        tpot_s = None
        # Timed from the choices that finished only, as before: one cut short is charged
        # its tokens, but its end is the client's leaving, not its last token.
        timed_tokens = usage.completion_tokens - self._unsettled.completion_tokens
        if first_token_s is not None and timed_tokens >= 2:
            tpot_s = (finished_s - first_token_s) / (timed_tokens - 1)
            metrics.tpot_s.labels(self.served_model, self.priority_class).observe(tpot_s)
        if self.degradation is not None:
            ttft_s = None if first_token_s is None else first_token_s - self.trace.arrival_s
            left_after_s = finished_s - self.trace.arrival_s if self.is_client_gone else None
            self.degradation.finished(ttft_s, tpot_s, left_after_s=left_after_s)
        if log.isEnabledFor(logging.INFO):
            log.info("%s", self.log_line(usage, finished_s, spend))
        await self.gateway.quotas.finish(
            self.lease,
            UsageTotals(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                spend_pusd=spend,
            ),
        )

    def log_line(self, usage: UsageCounts, finished_s: float, spend_pusd: int = 0) -> str:
        """``key=value`` pairs (logfmt). ``finish_reason`` lists each choice's, in order,
        ``none`` for one that never finished (an error, or the client left)."""
        trace, d = self.trace, self.degradation
        reasons = ",".join(self.finish_reasons.get(i, "none") for i in range(self.num_choices))
        ttft = trace.first_token_s
        ttft_ms = "none" if ttft is None else f"{(ttft - trace.arrival_s) * 1e3:.1f}"
        fields = [
            ("request_id", trace.request_id),
            *([("endpoint", self.endpoint)] if self.endpoint is not None else []),
            # The workers' id, when the caller brought its own (serving/types.py).
            *([("server_id", trace.server_id)] if trace.server_id != trace.request_id else []),
            ("tenant", self.tenant.name),
            ("priority_class", self.priority_class),
            # As the client asked for it, also when a fallback model answered.
            ("model", self.model if d is None else d.asked_model),
            *([("pool", self.pool)] if self.pool is not None else []),
            ("prompt_tokens", usage.prompt_tokens),
            ("completion_tokens", usage.completion_tokens),
            ("cached_tokens", usage.cached_tokens),
            ("spend_usd", _usd(spend_pusd)),
            ("finish_reason", reasons),
            ("ttft_ms", ttft_ms),
            ("e2e_ms", f"{(finished_s - trace.arrival_s) * 1e3:.1f}"),
            ("attempts", len(trace.routes)),
            # The degradation steps that changed it (degrade/service.py), as in its header.
            *([("degraded", d.header)] if d is not None and d.header is not None else []),
            *([("response_cache", "hit")] if self.is_replayed else []),
            *([("cascade", self.cascade)] if self.cascade is not None else []),
        ]
        return "request " + " ".join(f"{key}={_logfmt(value)}" for key, value in fields)


def unsettled_usage(
    prompt_tokens: Sequence[int],
    received_tokens: Mapping[int, int],
    settled_choices: Collection[int],
    *,
    settled_prompts: Collection[int],
    is_prefilled: bool,
    num_choices: int = 1,
) -> UsageCounts:
    """What the choices without a final usage computed: each one's completion tokens the
    gateway received from its worker, and each prompt none of whose choices settled, once
    a worker prefilled it.

    One prompt is prefilled once the request's first token came (``is_prefilled``). Of
    several (``num_choices`` choices, prompt i's are i * n .. i * n + n - 1: serving/job.py),
    those with a token received for one of their choices: a prompt whose first token had
    not come yet may have been prefilled meanwhile, but is not charged (a step's worth of
    doubt), where charging every prompt billed those no worker reached. Cached tokens are
    unknown without the worker's final message: none count, as serving/choice_stream.py
    estimates a missing usage."""
    completion = sum(n for index, n in received_tokens.items() if index not in settled_choices)
    if len(prompt_tokens) <= 1:
        reached = {0} if is_prefilled else set()
    else:
        per_prompt = max(1, num_choices // len(prompt_tokens))
        reached = {index // per_prompt for index, n in received_tokens.items() if n > 0}
    unsettled = reached.difference(settled_prompts)
    prompt = sum(n for i, n in enumerate(prompt_tokens) if i in unsettled)
    return UsageCounts(prompt_tokens=prompt, completion_tokens=completion)


def _usd(pusd: int) -> str:
    """Exact USD: every digit of the pico-dollars, trailing zeros dropped (0.000123)."""
    whole, frac = divmod(pusd, PICO_USD_PER_USD)
    return f"{whole}.{frac:012d}".rstrip("0").rstrip(".") if frac else str(whole)


def _logfmt(value: object) -> str:
    """A value as logfmt writes it: bare when plain, quoted otherwise (a model name is the
    operator's, but may hold spaces)."""
    text = str(value)
    if text and all(c.isalnum() or c in "-_.:/,@" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
