"""`kvflow up`: a gateway and workers on this machine, in one command.

Starts `kvflow worker` processes and a `kvflow router` in front of them (in-memory tenant
state, no API keys), shows their startup progress, prints the URL with ready-to-paste
`curl` and `openai` examples, and on Ctrl-C stops the gateway first, then the workers.
Children run in their own session, so the terminal's Ctrl-C reaches only us and the
shutdown happens in that order; their logs go to files named at startup.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import yaml

from kvflow.cli.up_models import (
    UpModel,
    UpModelsError,
    examples_many,
    pair_models,
    router_config,
)
from kvflow.proto.cli_args import number_of, port_number, positive_int, seconds
from kvflow.proto.roles import Role

# Worker log lines worth showing while it starts: model loading takes seconds.
_PROGRESS_MARKERS = ("loading model", "loaded in", "KV cache", "dequantiz", "Error", "error:")
STOP_TIMEOUT_S = 15.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    ready_line: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)


class Launcher:
    def __init__(self, log_dir: Path, out: TextIO) -> None:
        self.log_dir = log_dir
        self.out = out
        self.children: list[Child] = []
        self.started_s = time.monotonic()

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started_s:6.1f}s] {message}", file=self.out, flush=True)

    def start(self, name: str, args: Sequence[str], ready_prefix: str) -> Child:
        log_path = self.log_dir / f"{name.replace(' ', '-')}.log"
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "kvflow.cli.main", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # Ctrl-C in the terminal reaches only `kvflow up`
        )
        child = Child(name, proc, log_path)
        self.children.append(child)
        threading.Thread(target=self._pump, args=(child, ready_prefix), daemon=True).start()
        return child

    def _pump(self, child: Child, ready_prefix: str) -> None:
        assert child.proc.stdout is not None
        with child.log_path.open("w") as log:
            for line in child.proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(ready_prefix):
                    child.ready_line = line.strip()
                    child.ready.set()
                elif not child.ready.is_set() and any(m in line for m in _PROGRESS_MARKERS):
                    self.say(f"{child.name}: {line.split(': ', 1)[-1].strip()}")
        child.ready.set()  # exited: wake the waiter

    def wait_ready(self, child: Child, timeout_s: float) -> str:
        if not child.ready.wait(timeout_s) or child.ready_line is None:
            code = child.proc.poll()
            tail = "".join(child.log_path.read_text().splitlines(keepends=True)[-15:])
            state = f"exited with {code}" if code is not None else f"not ready in {timeout_s} s"
            raise RuntimeError(f"{child.name} {state}; the end of {child.log_path}:\n{tail}")
        return child.ready_line

    def stop_all(self) -> None:
        # The gateway first (it stops taking requests), then the workers (they drain).
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in reversed(self.children):
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)


def _wait_gateway_ready(url: str, num_workers: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
                if json.load(response)["workers_healthy"] >= num_workers:
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway at {url} did not see {num_workers} healthy workers")


def examples(url: str, model: str) -> str:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 100,
        }
    )
    return f"""
kvflow is running: {url}/v1  (model "{model}")

Try it with curl:

curl {url}/v1/chat/completions \\
  -H 'Content-Type: application/json' \\
  -d '{body}'

or with the openai package (pip install openai), streaming:

python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="unused")
stream = client.chat.completions.create(
    model="{model}",
    messages=[{{"role": "user", "content": "Tell me about the sea."}}],
    max_tokens=200,
    stream=True,
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
EOF

Press Ctrl-C to stop."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvflow up", description="Run a kvflow gateway and workers on this machine."
    )
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="disaggregated: this many prefill workers (with --decode-workers; replaces --workers)",
    )
    p.add_argument(
        "--decode-workers", type=int, default=0, help="disaggregated: this many decode workers"
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway address (default: loopback)")
    p.add_argument("--port", type=port_number, default=8000, help="gateway port (0: any free port)")
    p.add_argument(
        "--model",
        action="append",
        help="HF folder or .gguf (default: built-in SmolLM2-135M-Instruct); repeat it with "
        "--served-model-name for several models, paired by position",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        help="the name clients use (default: smollm2); repeat it for several models, each "
        "its own pool of --workers behind the one gateway",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=number_of("GiB", allow_zero=False),
        default=1.0,
        help="KV cache per worker",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the workers' dtype (default auto: a bfloat16 checkpoint in bfloat16 on a CPU "
        "with AVX512-BF16 or AMX; a GGUF, the built-in model among them, in float32)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="split each worker's model over this many ranks (processes sharing this "
        "machine's cores)",
    )
    p.add_argument(
        "--quantization",
        choices=("auto", "none"),
        default="auto",
        help="the workers' weights (default auto: a GGUF's quantized weights stay quantized, "
        "4-bit planes multiplied by torch's int4 kernels; none: widened to --dtype)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "int8", "fp8"),
        default="auto",
        help="the workers' KV cache (default auto: the model's dtype; int8 or fp8: one byte "
        "per value and a scale per token and head, 1.94x the tokens of a bf16 cache and "
        "3.9x float32's in the same --kv-cache-gib)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="simulated workers (no model, random tokens): try the API without torch",
    )
    p.add_argument(
        "--tenants-file",
        type=Path,
        help="the gateway's tenants (API keys, quotas; docs/router.md): required to serve "
        "off loopback unless --allow-unauthenticated",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="with no tenants, serve anonymous callers (as admins) on a non-loopback --host",
    )
    p.add_argument("--startup-timeout-s", type=seconds(allow_zero=False), default=600.0)
    return p


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _start_workers(
    launcher: Launcher, args: argparse.Namespace, roles: list[Role], model: UpModel, num_models: int
) -> list[Child]:
    """Start one pool's workers (a pool per model)."""
    what = "simulated workers" if args.simulate else (model.model or "SmolLM2-135M-Instruct")
    of = f" for {model.served_model_name}" if num_models > 1 else ""
    launcher.say(f"starting {len(roles)} worker(s) of {what}{of}; logs in {launcher.log_dir}")
    model_args = ["--model", model.model] if model.model else []
    common = ["--served-model-name", model.served_model_name, *model_args]
    prefix = f"{model.pool} " if num_models > 1 else ""
    workers = []
    for i, role in enumerate(roles):
        worker_args = ["worker", "--port", "0", "--metrics-port", "0", "--kv-port", "0",
                       "--role", role, "--kv-cache-gib", str(args.kv_cache_gib),
                       "--dtype", args.dtype, "--quantization", args.quantization,
                       "--tensor-parallel-size", str(args.tensor_parallel_size),
                       *common]  # fmt: skip
        if args.kv_cache_dtype != "auto":
            worker_args += ["--kv-cache-dtype", args.kv_cache_dtype]
        if args.simulate:
            worker_args.append("--simulate")
        name = f"{prefix}worker {i + 1}" + ("" if role == Role.COLOCATED else f" ({role})")
        workers.append(launcher.start(name, worker_args, "KVFLOW_WORKER_READY"))
    return workers


def _wait_workers(launcher: Launcher, workers: list[Child], timeout_s: float) -> list[str]:
    """Wait for one pool's workers; their gRPC addresses."""
    addresses = []
    for child in workers:
        line = launcher.wait_ready(child, timeout_s)
        port = line.split("grpc_port=")[1].split()[0]
        addresses.append(f"127.0.0.1:{port}")
        launcher.say(f"{child.name}: ready on {addresses[-1]}")
    return addresses


def main(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    args = _parser().parse_args(list(argv))
    # `kill` (SIGTERM) stops us as cleanly as Ctrl-C does. SIGINT is set explicitly too: a
    # shell starts background jobs with SIGINT ignored, and Python keeps that inheritance.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Closing the terminal or the SSH session (SIGHUP) too: its default ends us without
    # stopping the gateway and workers, which run in sessions of their own and would keep
    # the ports.
    signal.signal(signal.SIGHUP, signal.default_int_handler)
    if args.workers < 1:
        print("kvflow up: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.tenants_file is None and not args.allow_unauthenticated and not _is_loopback(args.host):
        # Refused before any worker loads: the gateway would refuse to start anyway.
        print(
            f"kvflow up: --host {args.host} is not loopback and no tenants are configured: "
            "anyone who reaches it would be an admin. Pass --tenants-file, keep the default "
            "--host 127.0.0.1, or pass --allow-unauthenticated",
            file=sys.stderr,
        )
        return 2
    if args.simulate and args.kv_cache_dtype != "auto":
        print(
            "kvflow up: simulated workers have no KV cache to quantize: drop --kv-cache-dtype "
            "or --simulate",
            file=sys.stderr,
        )
        return 2
    roles = [Role.COLOCATED] * args.workers
    if args.prefill_workers or args.decode_workers:
        if args.prefill_workers < 1 or args.decode_workers < 1:
            print(
                "kvflow up: a disaggregated pool needs --prefill-workers and --decode-workers, "
                "both at least 1",
                file=sys.stderr,
            )
            return 2
        roles = [Role.PREFILL] * args.prefill_workers + [Role.DECODE] * args.decode_workers
    try:
        models = pair_models(args.model, args.served_model_name)
    except UpModelsError as exc:
        print(f"kvflow up: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="kvflow-up-"))
    launcher = Launcher(log_dir, out)
    try:
        # Every pool's workers start at once: they load their models side by side.
        pools = [_start_workers(launcher, args, roles, m, len(models)) for m in models]
        addresses = [_wait_workers(launcher, p, args.startup_timeout_s) for p in pools]
        if len(models) == 1:
            model_args = ["--model", models[0].model] if models[0].model else []
            name_args = ["--served-model-name", models[0].served_model_name]
            router_args = ["--workers", ",".join(addresses[0]), *name_args, *model_args]
        else:
            config_path = log_dir / "router.yaml"
            config_path.write_text(yaml.safe_dump(router_config(models, addresses)))
            launcher.say(f"gateway: {len(models)} pools, config in {config_path}")
            router_args = ["--config", str(config_path)]
        if args.tenants_file is not None:
            router_args += ["--tenants-file", str(args.tenants_file.resolve())]
        if args.allow_unauthenticated:
            router_args.append("--allow-unauthenticated")
        gateway = launcher.start(
            "gateway",
            ["router", "--host", args.host, "--port", str(args.port), *router_args],
            "KVFLOW_ROUTER_READY",
        )
        port = launcher.wait_ready(gateway, args.startup_timeout_s).split("port=")[1]
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host}:{port}"
        _wait_gateway_ready(url, len(roles) * len(models), args.startup_timeout_s)
        launcher.say(f"gateway: ready on {url}")
        names = [m.served_model_name for m in models]
        text = examples(url, names[0]) if len(names) == 1 else examples_many(url, names)
        if args.tenants_file is not None:
            note = (
                f"Tenants are on ({args.tenants_file}): add -H 'Authorization: Bearer "
                'YOUR_KEY\' to curl, and api_key="YOUR_KEY" to OpenAI(...).'
            )
            text = text.replace("\n\nPress Ctrl-C to stop.", f"\n\n{note}\n\nPress Ctrl-C to stop.")
        print(text, file=out, flush=True)
        while (exited := launcher.first_exited()) is None:
            time.sleep(0.5)
        print(f"\nkvflow up: {exited.name} exited ({exited.proc.returncode}); see "
              f"{exited.log_path}. Stopping.", file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt:
        print("\nkvflow up: stopping...", file=out, flush=True)
        return 0
    except RuntimeError as exc:
        print(f"kvflow up: {exc}", file=sys.stderr)
        return 1
    finally:
        launcher.stop_all()
        print("kvflow up: stopped.", file=out, flush=True)
