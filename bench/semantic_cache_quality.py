"""The semantic cache's precision and recall over similarity thresholds (docs/benchmarks.md,
"Semantic cache quality").

Embeds both sides of every labelled pair in bench/data/semantic_cache_pairs.json
(paraphrases that should share an answer; near-misses that must not: other numbers,
entities, negation, opposites) with the embedding model the gateway's embedding workers
run (wordllama-l2-supercat, 256 dimensions, engine_worker/embed/model.py), and counts, at
each threshold, a pair at or above it as a predicted match, as the cache's lookup does
(caches/semantic.py), both by cosine alone and with the lookup's number guard (texts whose
numbers differ never match). Precision: of the predicted matches, the share that are paraphrases
(a near-miss above the threshold is a wrong answer served). Recall: of the paraphrases,
the share found.

    python bench/semantic_cache_quality.py --json docs/bench-data/semantic_cache_quality.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any

from kvflow.engine_worker.embed.model import StaticEmbedder
from kvflow.engine_worker.embed.model_files import embedding_model_files
from kvflow.router.caches.semantic import cosine, numbers_in

ROOT = Path(__file__).resolve().parent
PAIRS = ROOT / "data" / "semantic_cache_pairs.json"
THRESHOLDS = [round(0.70 + 0.01 * i, 2) for i in range(30)]


def similarities(pairs: list[dict[str, Any]], dimensions: int) -> list[float]:
    model = StaticEmbedder.load(embedding_model_files(None))
    texts = [p["a"] for p in pairs] + [p["b"] for p in pairs]
    vectors = model.embed(model.tokenize(texts), dimensions).tolist()
    n = len(pairs)
    return [cosine(vectors[i], vectors[n + i]) for i in range(n)]


def guarded(pairs: list[dict[str, Any]], sims: list[float]) -> list[float]:
    """The similarities as the cache's lookup sees them: a pair whose numbers differ never
    matches (caches/semantic.py, numbers_in)."""
    return [
        s if numbers_in(p["a"]) == numbers_in(p["b"]) else -1.0
        for p, s in zip(pairs, sims, strict=True)
    ]


def scores(labels: list[bool], sims: list[float], threshold: float) -> dict[str, Any]:
    tp = sum(1 for m, s in zip(labels, sims, strict=True) if m and s >= threshold)
    fp = sum(1 for m, s in zip(labels, sims, strict=True) if not m and s >= threshold)
    positives = sum(labels)
    return {
        "threshold": threshold,
        "true_positives": tp,
        "false_positives": fp,
        "precision": tp / (tp + fp) if tp + fp else 1.0,
        "recall": tp / positives if positives else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dimensions", type=int, default=256)
    p.add_argument("--json", type=Path, help="write the raw results here")
    args = p.parse_args()
    pairs = json.loads(PAIRS.read_text())["pairs"]
    sims = similarities(pairs, args.dimensions)
    labels = [bool(p["match"]) for p in pairs]
    table = [scores(labels, sims, t) for t in THRESHOLDS]
    with_guard = [scores(labels, guarded(pairs, sims), t) for t in THRESHOLDS]
    print("threshold  cosine only: precision recall FP | with the number guard: same")
    for row, g in zip(table, with_guard, strict=True):
        print(f"{row['threshold']:.2f}  {row['precision']:.3f} {row['recall']:.3f} "
              f"{row['false_positives']:2d} | {g['precision']:.3f} {g['recall']:.3f} "
              f"{g['false_positives']:2d}")  # fmt: skip
    result = {
        "benchmark": "semantic_cache_quality",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "model": "wordllama-l2-supercat",
        "dimensions": args.dimensions,
        "num_pairs": len(pairs),
        "num_paraphrases": sum(labels),
        "num_near_misses": len(labels) - sum(labels),
        "thresholds_cosine_only": table,
        "thresholds_with_number_guard": with_guard,
        "pairs": [
            {"a": p["a"], "b": p["b"], "match": p["match"], "similarity": round(s, 4)}
            for p, s in zip(pairs, sims, strict=True)
        ],
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
