"""The routing core: which worker serves a request. Pure: no I/O, no clocks, no sockets.

filters -> weighted scorers -> picker (`pipeline.RoutingPipeline`), fed by `BlockIndex`
(which worker caches which block) and `WorkerView` snapshots the I/O shell keeps current.
"""
