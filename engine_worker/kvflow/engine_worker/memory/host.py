"""What memory this machine, or this container, can still give: /proc/meminfo and the cgroup.

On Kubernetes a pod's memory limit is what matters: the machine may have 500 GiB free while
the container is killed at its 8 GiB limit. The cgroup's usage counts page cache, of which
the inactive file pages are reclaimed before the limit kills anything (the kubelet's
"working set" leaves them out for the same reason), so the room left is
``limit - (usage - inactive_file)``. The parsers are pure; ``host_memory`` reads the files.
"""

from __future__ import annotations

from pathlib import Path

from kvflow.engine_worker.memory.budget import HostMemory

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 says "no limit" with a huge number (2^63 rounded down to a page); anything past
# 2^60 bytes (an exbibyte) is taken for that.
_NO_LIMIT_BYTES = 1 << 60


def mem_available(meminfo_text: str) -> int:
    """``MemAvailable`` of /proc/meminfo, in bytes."""
    for line in meminfo_text.splitlines():
        key, _, rest = line.partition(":")
        if key == "MemAvailable":
            value, *unit = rest.split()
            assert unit in ([], ["kB"]), line
            return int(value) * (1024 if unit else 1)
    raise ValueError("/proc/meminfo has no MemAvailable line (Linux 3.14 or later has one)")


def cgroup_room(limit_text: str, usage_text: str, stat_text: str, inactive_key: str) -> int | None:
    """What a cgroup can still charge before its limit: None when it has no limit."""
    limit = limit_text.strip()
    if limit == "max" or int(limit) >= _NO_LIMIT_BYTES:
        return None
    inactive = 0
    for line in stat_text.splitlines():
        key, _, value = line.partition(" ")
        if key == inactive_key:
            inactive = int(value)
    working_set = max(0, int(usage_text) - inactive)
    return max(0, int(limit) - working_set)


def host_memory(root: Path = CGROUP_ROOT, meminfo: Path = MEMINFO) -> HostMemory:
    """The tighter of MemAvailable and the cgroup's room (v2 ``memory.max``, else v1
    ``memory/memory.limit_in_bytes``)."""
    best = HostMemory(mem_available(meminfo.read_text()), "the machine's MemAvailable")
    for limit, usage, stat, key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        (
            "memory/memory.limit_in_bytes",
            "memory/memory.usage_in_bytes",
            "memory/memory.stat",
            "total_inactive_file",
        ),
    ):
        try:
            room = cgroup_room(
                (root / limit).read_text(),
                (root / usage).read_text(),
                (root / stat).read_text(),
                key,
            )
        except (OSError, ValueError):
            continue  # not this cgroup version, or not readable here
        if room is not None and room < best.available_bytes:
            best = HostMemory(room, f"the container's memory limit ({root / limit})")
        break
    return best
