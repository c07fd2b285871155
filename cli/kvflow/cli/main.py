"""`kvflow <command> [args]`: dispatch to the component that owns the command.

Components are imported lazily by name, so `kvflow router` works in an image that has no
torch, and a missing extra is reported with the pip command that installs it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    extra: str
    help: str


COMMANDS: dict[str, Command] = {
    "up": Command("kvflow.cli.up", "dev", "run a gateway and workers on this machine"),
    "worker": Command(
        "kvflow.engine_worker.cli", "worker", "serve a model over gRPC (torch engine)"
    ),
    "router": Command("kvflow.router.cli", "router", "run the OpenAI-compatible gateway"),
    "operator": Command("kvflow.operator.cli", "operator", "run the Kubernetes operator"),
    "bench": Command(
        "kvflow.cli.bench", "router", "load an OpenAI-compatible endpoint and report latency"
    ),
    "sim": Command(
        "kvflow.cli.sim",
        "dev",
        "virtual-time clusters (run, compare, overload, cascade, batch-day, calibrate)",
    ),
    "plan": Command(
        "kvflow.cli.plan.cli", "router", "size GPUs, memory and cost for a model and a load"
    ),
    "profile": Command(
        "kvflow.engine_worker.sim.profile_cli",
        "worker",
        "fit a simulated-worker profile to the engine",
    ),
}


def _usage() -> str:
    lines = ["usage: kvflow <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {cmd.help}" for name, cmd in COMMANDS.items()]
    lines += ["", "`kvflow <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"kvflow: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("kvflow."):
            raise
        print(
            f"kvflow {name}: missing dependency {exc.name!r}; "
            f"install it with: pip install 'kvflow[{command.extra}]'",
            file=sys.stderr,
        )
        return 2
    entry: Callable[[list[str]], int] = module.main
    return entry(rest)


if __name__ == "__main__":
    sys.exit(main())
