"""Virtual-time clusters: real engines and the real routing pipeline on a discrete-event clock.

Each simulated worker is a real ``kvflow.engine_worker.core.engine.Engine`` (scheduler,
block pool, prefix cache, preemption, KV events) whose runner charges a timing model's
seconds to the worker's own clock instead of sleeping; the router side is
``kvflow.router.routing`` fed with those engines' KV events and load, as the gateway's
worker pool feeds it. One process, deterministic for a seed, immune to how busy the
machine is. See docs/simulator.md.
"""
