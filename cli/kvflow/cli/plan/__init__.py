"""`kvflow plan`: how many GPUs a model and a traffic mix need (docs/plan.md).

A pure core (``memory``, ``steps``, ``capacity``, ``plan``: arithmetic on typed records)
and a thin shell (``cli``, the file readers, ``report``). GPU datasheets and the Llama-3
shapes come from the simulator's ``kvflow.engine_worker.sim.hardware``, so the planner and
the simulated workers size the same hardware the same way.
"""
