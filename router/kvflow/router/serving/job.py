"""One completion request as a value, worked out once before generation starts.

Pure. The route handler (api/completions.py) parses the body, has a `CompletionJob` built
(api/job_start.py: gates, quotas, prompts prepared, token budget planned), runs it, and
answers in the request's wire format (api/respond.py). Everything below the route reads
the request from here, so nothing is worked out twice: the prompts, the sampling with its
defaults, each prompt's max_tokens, the tenant as one value, the ids and the trace.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvflow.proto.priority_class import PriorityClass
from kvflow.router.protocol.requests import ChatRequest, CompletionRequest, SamplingOptions
from kvflow.router.serving.prompts import PreparedPrompt
from kvflow.router.serving.token_budget import TokenBudget
from kvflow.router.serving.types import Caller, ChoiceSpec, RequestTrace
from kvflow.router.tenants.config import Tenant


@dataclass(frozen=True)
class TenantContext:
    """Who a request runs for: the tenant (its name, priority, quotas and limits) with this
    request's cache salt (its `prompt_cache_key`'s under the tenant's, tenants/prompt_cache.py),
    and the sticky session it asked for. One value instead of loose fields, so a layer
    cannot pair one tenant's salt with another's priority."""

    tenant: Tenant
    session_id: str | None = None
    # The class the request runs as: what it asked for, capped to the tenant's ceiling
    # (protocol/priority_class.py).
    priority_class: PriorityClass = PriorityClass.NORMAL

    @property
    def name(self) -> str:
        return self.tenant.name

    @property
    def is_admin(self) -> bool:
        return self.tenant.is_admin


@dataclass(frozen=True)
class ServedBy:
    """The pool a request was routed to."""

    pool: str
    served_model: str  # what the pool's workers serve the model as: the response's `model`
    # The pool's name in headers and logs: only when the gateway has several.
    pool_label: str | None = None


@dataclass(frozen=True)
class CompletionJob:
    request: ChatRequest | CompletionRequest
    tenant: TenantContext
    served_by: ServedBy
    trace: RequestTrace
    prompts: tuple[PreparedPrompt, ...]
    sampling: SamplingOptions  # the request's, its left-out fields filled with the defaults
    budget: TokenBudget  # each prompt's max_tokens and the quota reservation
    template_source: str | None  # the chat template's, for tool-call extraction
    response_id: str
    created_s: int
    # The caller asked for the route header and may see it (admins only).
    wants_route: bool = False
    # Admitted past a budget's warning fraction: the header's text (api/job_start.py).
    budget_warning: str | None = None
    # The degradation steps that changed this request: the header's text (degrade/).
    degraded: str | None = None
    # What the response cache did (hit, miss, bypass; caches/): its header. None: it is off.
    response_cache: str | None = None
    semantic_cache: str | None = None  # x-kvflow-semantic-cache (caches/semantic_service.py)

    @property
    def is_chat(self) -> bool:
        return isinstance(self.request, ChatRequest)

    @property
    def num_choices(self) -> int:
        return self.sampling.n * len(self.prompts)

    @property
    def echo(self) -> list[str] | None:
        """Each prompt's text, when a /v1/completions request asked for it back."""
        is_echo = isinstance(self.request, CompletionRequest) and self.request.echo
        return [p.text for p in self.prompts] if is_echo else None

    @property
    def caller(self) -> Caller:
        t = self.tenant
        return Caller(t.tenant, self.served_by.served_model, t.session_id, t.priority_class)

    def specs(self) -> list[ChoiceSpec]:
        """One spec per choice: prompt i's choices are i * n .. i * n + n - 1."""
        s, n = self.sampling, self.sampling.n
        return [
            ChoiceSpec(
                index=i * n + j,
                prompt_index=i,
                prompt_token_ids=prompt.token_ids,
                sampling=_choice_sampling(replace(s, max_tokens=self.budget.max_tokens[i]), j),
            )
            for i, prompt in enumerate(self.prompts)
            for j in range(n)
        ]

    def route_header(self) -> str:
        """Each attempt's route, after the pool that answered when there are several."""
        label = self.served_by.pool_label
        prefix = f"pool={label}; " if label is not None else ""
        return ", ".join(prefix + route for route in self.trace.routes)


def _choice_sampling(s: SamplingOptions, j: int) -> SamplingOptions:
    # n > 1 with a seed: each choice its own reproducible stream, not n copies of one.
    return s if s.seed is None or j == 0 else replace(s, seed=s.seed + j)
