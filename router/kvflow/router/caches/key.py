"""What a cached answer is stored under: pure derivation, no I/O.

A key is a digest of everything that decides the answer:

- the namespace (`--quota-scope`): gateways of different pools sharing one Redis never mix;
- the tenant (its name, and the request's `prompt_cache_key`): a tenant never reads
  another's answers, nor a user one that another user's key stored;
- the model version: the pool, the name its workers serve, and the model identity they
  report (hash seed, vocabulary, context length, EOS ids), so a pool whose model changes
  stops matching its old entries;
- the prompt template version: a hash of the chat template's source;
- the request: messages, prompts, tools, tool choice, response format, every sampling field
  after the defaults are applied. Not what only changes the wire format (``stream``,
  ``stream_options``) nor the name the client used for the model (aliases of one pool
  share answers; the pool is in the version). At temperature 0 the worker decodes greedily
  and ignores top_p, top_k, min_p and the seed: they are left out, so every greedy request
  for the same input shares one answer (also the twin a degraded pool answers a sampled
  request with: caches/policy.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvflow.proto import worker_pb2 as pb
from kvflow.router.protocol.requests import ChatRequest, CompletionRequest, SamplingOptions

# Bumped when the stored answer's format or the fingerprint's fields change: older entries
# then never match.
KEY_FORMAT = "v2"
# Fields that change the response's shape, not its content, or name no generation input.
_WIRE_ONLY = frozenset({"model", "stream", "stream_options", "unset"})


@dataclass(frozen=True)
class ModelVersion:
    """The model and prompt template versions a pool answers with, as the router knows them."""

    pool: str
    model: str  # digest of the served name and the workers' model identity
    template: str  # digest of the chat template's source ("" without one)


def model_version(
    pool: str, served_name: str, info: pb.WorkerInfo, template_source: str | None
) -> ModelVersion:
    identity = _canonical(
        {
            "served": served_name,
            "hash_seed": info.hash_seed.hex(),
            "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len,
            "eos_token_ids": list(info.eos_token_ids),
        }
    )
    template = "" if template_source is None else _digest(template_source)
    return ModelVersion(pool, _digest(identity), template)


@dataclass(frozen=True)
class TenantScope:
    """Whose answers these are: the tenant, and the user under it (``prompt_cache_key``)."""

    name: str
    user: str | None = None


def tenant_user(body: object) -> str | None:
    """The body's ``prompt_cache_key`` as text (any JSON value keys by its JSON text, as
    the prefix cache's salt does: tenants/prompt_cache.py); None without one."""
    key = body.get("prompt_cache_key") if isinstance(body, dict) else None
    if key is None:
        return None
    return key if isinstance(key, str) else _canonical(key)


def request_fingerprint(parsed: ChatRequest | CompletionRequest, sampling: SamplingOptions) -> str:
    """A digest of the request's generation inputs; ``sampling``: the request's with the
    pool's defaults filled in (serving/defaults.py)."""
    fields = _plain(parsed)
    assert isinstance(fields, dict)
    fields["sampling"] = _plain(greedy_normalized(sampling))
    fields["kind"] = "chat" if isinstance(parsed, ChatRequest) else "completion"
    return _digest(_canonical(fields))


def greedy_normalized(sampling: SamplingOptions) -> SamplingOptions:
    """``sampling`` without the fields greedy decoding ignores, at temperature 0; else as is."""
    if sampling.temperature != 0:
        return sampling
    # What the worker's greedy decoding ignores (engine_worker/sampler.py), at "off".
    return dataclasses.replace(sampling, top_p=None, top_k=0, min_p=0.0, seed=None)


def cache_key(namespace: str, scope: TenantScope, version: ModelVersion, fingerprint: str) -> str:
    """The store's key. The pool and tenant stay readable (an explicit purge selects by
    them); everything else is in the digest."""
    return scoped_key("rcache", KEY_FORMAT, namespace, scope, version, fingerprint)


def key_prefix(namespace: str, pool: str | None = None, tenant: str | None = None) -> str:
    """Keys under a pool and tenant; None stops the prefix there (a purge's selection)."""
    return store_prefix("rcache", namespace, pool, tenant)


def tenant_of(namespace: str, key: str) -> str:
    """The tenant a key of ``namespace``'s exact cache belongs to (``cache_key``): the
    memory store evicts the largest tenant's entries first (stores.py)."""
    _, _, tenant = key.removeprefix(store_prefix("rcache", namespace)).partition(":")
    return tenant.partition(":")[0]


def scoped_key(
    kind: str,
    key_format: str,
    namespace: str,
    scope: TenantScope,
    version: ModelVersion,
    request_digest: str,
) -> str:
    """A key of either cache (``kind`` rcache: the exact one, scache: the semantic one):
    the pool and tenant readable, then one digest of the key format, the tenant and its
    user, the model and template versions and ``request_digest`` (what else of the request
    must be equal)."""
    digest = _digest(
        _canonical(
            [key_format, scope.name, scope.user, version.model, version.template, request_digest]
        )
    )
    return store_prefix(kind, namespace, version.pool, scope.name) + digest


def store_prefix(
    kind: str, namespace: str, pool: str | None = None, tenant: str | None = None
) -> str:
    """A cache's keys under a pool and tenant; None stops the prefix there (a purge's
    selection)."""
    prefix = f"kvflow:{namespace}:{kind}:"
    if pool is None:
        return prefix
    prefix += f"{pool}:"
    return prefix if tenant is None else prefix + f"{tenant}:"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _plain(value: object) -> Any:
    """``value`` as JSON data, deterministically: dataclasses as mappings of their compared
    fields (a constraint's ``param`` names where it came from, not what it asks), sets sorted.
    Anything else fails loudly: a field the key cannot see would make two requests collide."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.compare and f.name not in _WIRE_ONLY
        }
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, frozenset | set):
        return sorted(_canonical(_plain(v)) for v in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"no canonical form for {type(value).__name__} in a response-cache key")
