"""`kvflow bench`: workloads, arrivals, a streaming load runner, metrics and reports.

Workloads, arrivals, metrics and reports are pure (no I/O, no clock), so a virtual-time
simulator can drive the same definitions; only ``client``, ``runner``, ``ladder``,
``plots`` and ``cli`` touch the network, the clock or files. See docs/bench.md.
"""
