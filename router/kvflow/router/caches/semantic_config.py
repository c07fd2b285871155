"""The semantic cache's settings: the config file's ``semantic_cache`` section (docs/router.md,
"Semantic cache"). Off unless the section names models; each tenant opts in too
(``semantic_cache: true`` in its entry, tenants/config.py).

    semantic_cache:
      embedding_model: wordllama-l2-supercat   # a public model name whose workers embed
      threshold: 0.97            # cosine similarity at or above which a stored answer is replayed
      ttl_s: 300                 # how long an entry is kept
      max_entries_per_scope: 256 # the newest entries of one scope are kept (a linear scan)
      max_mib: 32                # the in-process store's bound over all scopes (without Redis)
      embed_timeout_s: 2         # an embedding slower than this is a miss
      models:                    # public model names that opt in, each may set its threshold
        chat: {}
        support-bot: {threshold: 0.98}
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kvflow.router.config_fields import ConfigError, check_keys

# Measured on bench/data/semantic_cache_pairs.json with wordllama-l2-supercat
# (docs/benchmarks.md, "Semantic cache quality"): the lowest threshold whose precision is
# within reach of the best; below it near-misses (other numbers, entities) start matching.
DEFAULT_THRESHOLD = 0.97
MIB = 1024 * 1024


@dataclass(frozen=True)
class SemanticCacheConfig:
    embedding_model: str | None = None  # None: the semantic cache is off
    threshold: float = DEFAULT_THRESHOLD
    ttl_s: float = 300.0
    max_entries_per_scope: int = 256
    max_mib: float = 32.0
    embed_timeout_s: float = 2.0
    # Public model name -> its threshold.
    models: Mapping[str, float] = field(default_factory=dict)

    @property
    def is_enabled(self) -> bool:
        return self.embedding_model is not None and bool(self.models)

    @property
    def max_bytes(self) -> int:
        return int(self.max_mib * MIB)

    def threshold_of(self, model: str) -> float | None:
        """The model's threshold; None when it has not opted in."""
        return self.models.get(model)


_KEYS = {"embedding_model", "threshold", "ttl_s", "max_entries_per_scope", "max_mib",
         "embed_timeout_s", "models"}  # fmt: skip


def parse_semantic_cache(
    raw: object, public_names: Collection[str] | None, generating: Collection[str] = ()
) -> SemanticCacheConfig:
    """``public_names``: the names the config routes (None: one pool from the command line,
    one model: it cannot both embed and generate). ``generating``: names the config already
    knows generate (a cascade's, a degradation ladder's)."""
    where = "semantic_cache"
    if raw is None:
        return SemanticCacheConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping")
    check_keys(raw, _KEYS, where)
    if public_names is None:
        raise ConfigError(
            f"{where} needs a pools section: the embedding model runs in a pool of its own "
            "(`kvflow worker --task embed`) beside the pools that generate"
        )
    model = raw.get("embedding_model")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{where}.embedding_model must name the embedding model")
    if model not in public_names:
        raise ConfigError(
            f"{where}.embedding_model: {model!r} is not a model this gateway serves by a "
            f"configured name (give its pool served_model_name: {model}); known: "
            f"{sorted(public_names)}"
        )
    threshold = _number(raw, "threshold", DEFAULT_THRESHOLD, where, upper=1.0)
    models_raw = raw.get("models") or {}
    if not isinstance(models_raw, dict):
        raise ConfigError(f"{where}.models must be a mapping of model name -> {{threshold}}")
    models: dict[str, float] = {}
    for name, given in models_raw.items():
        at = f"{where}.models.{name}"
        if name not in public_names:
            raise ConfigError(f"{at}: {name!r} is not a model this gateway serves; known: "
                              f"{sorted(public_names)}")  # fmt: skip
        item = given or {}
        if not isinstance(item, dict):
            raise ConfigError(f"{at} must be a mapping ({{}} or {{threshold: ...}})")
        check_keys(item, {"threshold"}, at)
        models[name] = _number(item, "threshold", threshold, at, upper=1.0)
    if model in models or model in generating:
        raise ConfigError(
            f"{where}.embedding_model: {model!r} generates text (it is configured as a "
            "generating model here); name a model served by `kvflow worker --task embed`"
        )
    return SemanticCacheConfig(
        embedding_model=model,
        threshold=threshold,
        ttl_s=_number(raw, "ttl_s", 300.0, where),
        max_entries_per_scope=_count(raw, "max_entries_per_scope", 256, where),
        max_mib=_number(raw, "max_mib", 32.0, where),
        embed_timeout_s=_number(raw, "embed_timeout_s", 2.0, where),
        models=models,
    )


def _number(
    raw: Mapping[str, object], key: str, default: float, where: str, upper: float = math.inf
) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}.{key} must be a number, got {value!r}")
    if not (0 < value <= upper) or not math.isfinite(value):
        bound = "" if upper == math.inf else f" and <= {upper}"
        raise ConfigError(f"{where}.{key} must be > 0{bound}, got {value!r}")
    return float(value)


def _count(raw: Mapping[str, object], key: str, default: int, where: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}.{key} must be a positive integer, got {value!r}")
    return value
