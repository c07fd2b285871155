"""The SLO planner's pure model: replica decisions from observed metrics (no I/O).

`types.py` is the contract the operator calls through; docs/planner.md explains the model.
Held by import-linter: nothing here imports kopf, kubernetes, an HTTP client or the
operator's I/O modules.
"""
