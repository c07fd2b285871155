"""Public model names -> pools, pure: aliases, weighted splits between versions, and the
draw that picks a target (a session's stable hash, or the gateway's seeded RNG).

The YAML `models:` section:

```yaml
models:
  - name: smollm2                 # the name clients send as `model`
    aliases: [chat]               # more names for the same entry
    targets:                      # weights: integers >= 0, sum > 0
      - {pool: smollm-v1, weight: 95}
      - {pool: smollm-v2, weight: 5}
```

Public names are every entry's name and aliases plus every pool's served name (so a client
can pin a version); an entry shadows a pool's served name equal to it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.router.config_fields import ConfigError, check_keys

# 2**64: a session hash's first 8 bytes, as a fraction of this, is its draw in [0, 1).
_DRAW_SCALE = float(1 << 64)


@dataclass(frozen=True)
class Target:
    pool: str
    weight: int


@dataclass(frozen=True)
class ModelEntry:
    name: str
    aliases: tuple[str, ...]
    targets: tuple[Target, ...]

    def pick(self, draw: float, is_serving: Callable[[str], bool] = lambda pool: True) -> str:
        """The pool at ``draw`` (in [0, 1)) on the targets' cumulative weights: a target of
        weight w out of W is picked for a w/W share of the draws, one of weight 0 never.

        Targets whose pool is not serving (no healthy worker) are left out while another
        is: a canary that is down must not fail its share of requests, they go to the
        versions that can answer, in their weights' proportions. With none serving, the
        draw is over all of them (and the pool it picks answers 503 naming itself)."""
        assert 0.0 <= draw < 1.0, draw
        weighted = [t for t in self.targets if t.weight > 0]
        targets = [t for t in weighted if is_serving(t.pool)] or weighted
        point = draw * sum(t.weight for t in targets)
        cumulative = 0
        for target in targets:
            cumulative += target.weight
            if point < cumulative:
                return target.pool
        # Only float rounding gets here (draw just under 1): the last weighted target.
        return targets[-1].pool


def session_draw(session_id: str) -> float:
    """A stable draw in [0, 1) for a session: the same on every router replica and restart,
    so a session keeps its version (and its warm prefix cache) for its whole life."""
    digest = hashlib.sha256(session_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / _DRAW_SCALE


@dataclass(frozen=True)
class ModelRoutes:
    entries: tuple[ModelEntry, ...] = ()

    def _entry(self, name: str) -> ModelEntry | None:
        for entry in self.entries:
            if name == entry.name or name in entry.aliases:
                return entry
        return None

    def public_names(self, served_by_pool: Mapping[str, str]) -> list[str]:
        """Every name a client may send, sorted; ``served_by_pool``: pool -> served name,
        for the pools whose name is known."""
        names = {n for e in self.entries for n in (e.name, *e.aliases)}
        return sorted(names | set(served_by_pool.values()))

    def resolve(
        self,
        name: str,
        draw: float,
        served_by_pool: Mapping[str, str],
        is_serving: Callable[[str], bool] = lambda pool: True,
    ) -> str | None:
        """The pool that answers ``name`` at ``draw``; None: no such public name. An entry
        wins over a pool's served name; pools with one served name: the first listed.
        ``is_serving(pool)``: whether a pool can answer now (see ModelEntry.pick)."""
        entry = self._entry(name)
        if entry is not None:
            return entry.pick(draw, is_serving)
        return next((pool for pool, served in served_by_pool.items() if served == name), None)

    def pools_of(self, name: str) -> list[str]:
        """The pools an entry may send ``name`` to (weight > 0); [] for no entry."""
        entry = self._entry(name)
        return [] if entry is None else [t.pool for t in entry.targets if t.weight > 0]


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _target(raw: object, where: str, pools: Collection[str]) -> Target:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping {{pool: NAME, weight: N}}")
    check_keys(raw, {"pool", "weight"}, where)
    pool = _name(raw.get("pool"), f"{where}.pool")
    if pool not in pools:
        raise ConfigError(f"{where}.pool names an unknown pool {pool!r}; pools: {sorted(pools)}")
    weight = raw.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
        raise ConfigError(f"{where}.weight must be an integer >= 0, got {weight!r}")
    return Target(pool, weight)


def _entry(raw: object, where: str, pools: Collection[str]) -> ModelEntry:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with name and targets")
    check_keys(raw, {"name", "aliases", "targets"}, where)
    name = _name(raw.get("name"), f"{where}.name")
    aliases = raw.get("aliases") or []
    if not isinstance(aliases, list):
        raise ConfigError(f"{where}.aliases must be a list of names")
    targets = raw.get("targets")
    if not isinstance(targets, list) or not targets:
        raise ConfigError(f"{where}.targets must be a list of at least one {{pool, weight}}")
    parsed = tuple(_target(t, f"{where}.targets[{i}]", pools) for i, t in enumerate(targets))
    if sum(t.weight for t in parsed) <= 0:
        raise ConfigError(f"{where}.targets: the weights sum to 0; give one a weight > 0")
    return ModelEntry(
        name,
        tuple(_name(a, f"{where}.aliases[{i}]") for i, a in enumerate(aliases)),
        parsed,
    )


def parse_models(raw: object, pools: Sequence[str]) -> ModelRoutes:
    """The `models:` section over the pools named ``pools``; None: no entries (each pool
    answers to its served name). Raises ConfigError naming the field."""
    if raw is None:
        return ModelRoutes()
    if not isinstance(raw, list):
        raise ConfigError("models must be a list of {name, aliases, targets}")
    entries = tuple(_entry(item, f"models[{i}]", pools) for i, item in enumerate(raw))
    first_seen: dict[str, str] = {}
    for i, entry in enumerate(entries):
        fields = [(f"models[{i}].name", entry.name)]
        fields += [(f"models[{i}].aliases[{j}]", a) for j, a in enumerate(entry.aliases)]
        for where, name in fields:
            if name in first_seen:
                raise ConfigError(
                    f"{where}: the public name {name!r} is already {first_seen[name]}; "
                    "each name must route to one entry"
                )
            first_seen[name] = where
    return ModelRoutes(entries)


def describe(routes: ModelRoutes) -> list[dict[str, Any]]:
    """The entries as plain data, for the startup log."""
    return [
        {"name": e.name, "aliases": list(e.aliases),
         "targets": {t.pool: t.weight for t in e.targets}}
        for e in routes.entries
    ]  # fmt: skip
