"""`kvflow up`: the README's run command. Its printed examples must work as pasted, and
Ctrl-C must leave no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VENV_BIN = str(Path(sys.executable).parent)


def children_of(pid: int) -> set[int]:
    """Every descendant of ``pid``, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextmanager
def kvflow_up(*args: str, timeout_s: float = 300) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Run `kvflow up ARGS --port 0` until it prints its examples; yields (process, output)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "up", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    done = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop." in line:
                done.set()
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert done.wait(timeout_s), f"kvflow up not ready in {timeout_s} s:\n{''.join(lines)}"
        assert proc.poll() is None, f"kvflow up exited:\n{''.join(lines)}"
        yield proc, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_printed(command: str) -> str:
    """Run a command exactly as printed, in bash, with this venv's python first on PATH."""
    env = {**os.environ, "PATH": VENV_BIN + os.pathsep + os.environ["PATH"]}
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def printed_examples(output: str) -> tuple[str, str, str]:
    url = re.search(r"kvflow is running: (http://\S+)/v1", output).group(1)  # type: ignore[union-attr]
    curl = re.search(r"^curl .*?}'$", output, re.S | re.M).group(0)  # type: ignore[union-attr]
    python = re.search(r"^python - <<'EOF'$.*?^EOF$", output, re.S | re.M).group(0)  # type: ignore[union-attr]
    return url, curl, python


def stop_and_check_clean(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> None:
    """``sig``: SIGINT is what Ctrl-C sends, SIGHUP what closing the terminal sends."""
    descendants = children_of(proc.pid)
    assert len(descendants) >= 2  # the gateway and at least one worker
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in descendants):
        assert time.monotonic() < deadline, "kvflow up left processes behind"
        time.sleep(0.1)


def test_kvflow_up_with_simulated_workers() -> None:
    with kvflow_up("--simulate", "--workers", "2") as (proc, output):
        assert "worker 1: ready on 127.0.0.1:" in output
        assert "worker 2: ready on 127.0.0.1:" in output
        url, curl, python = printed_examples(output)
        response = json.loads(run_printed(curl))
        assert response["object"] == "chat.completion"
        assert response["usage"]["completion_tokens"] > 0
        assert run_printed(python).strip()  # the streamed text
        models = openai.OpenAI(base_url=f"{url}/v1", api_key="x").models.list()
        assert [m.id for m in models.data] == ["smollm2"]
        stop_and_check_clean(proc)


def test_kvflow_up_stops_its_processes_when_its_terminal_closes() -> None:
    """SIGHUP once ended `kvflow up` alone: the gateway and workers, each in a session of
    its own, kept serving and held the ports."""
    with kvflow_up("--simulate") as (proc, _):
        stop_and_check_clean(proc, signal.SIGHUP)


def test_kvflow_up_with_the_default_model_answers() -> None:
    with kvflow_up("--workers", "1", timeout_s=600) as (proc, output):
        assert "worker 1: loading model" in output  # progress while the model loads
        # No --dtype: the built-in GGUF runs in float32 on any CPU, and the worker says why.
        assert "on cpu (float32; auto: a GGUF runs in float32" in output
        url, curl, _ = printed_examples(output)
        assert json.loads(run_printed(curl))["choices"][0]["message"]["content"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        answer = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=30,
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        stop_and_check_clean(proc)


def test_kvflow_up_disaggregated_ships_a_long_prompt() -> None:
    with kvflow_up("--simulate", "--prefill-workers", "1", "--decode-workers", "1") as (
        proc,
        output,
    ):
        assert "worker 1 (prefill): ready on" in output
        assert "worker 2 (decode): ready on" in output
        url, _, _ = printed_examples(output)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        raw = client.completions.with_raw_response.create(
            model="smollm2",
            prompt="tell me a story " * 200,  # about 800 tokens: worth a remote prefill
            max_tokens=8,
            extra_body={"ignore_eos": True},
            extra_headers={"x-kvflow-route": "1"},
        )
        assert "prefill=" in raw.headers["x-kvflow-route"]
        assert raw.parse().usage.completion_tokens == 8  # type: ignore[union-attr]
        stop_and_check_clean(proc)


def test_kvflow_up_gives_its_workers_the_kv_cache_dtype(tmp_path: Path) -> None:
    from testkit.tiny_model import write_tiny_llama
    from testkit.tokenizer_files import write_smollm2_tokenizer

    model = write_smollm2_tokenizer(write_tiny_llama(tmp_path / "tiny", seed=3))
    args = ("--model", str(model), "--served-model-name", "tiny", "--kv-cache-dtype", "int8")
    with kvflow_up(*args) as (proc, output):
        log_dir = Path(re.search(r"logs in (\S+)", output).group(1))  # type: ignore[union-attr]
        logs = "".join(p.read_text() for p in log_dir.glob("*worker*"))
        assert "KV cache int8+float16scales" in logs
        url, _, _ = printed_examples(output)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        answer = client.completions.create(
            model="tiny", prompt="hello", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        stop_and_check_clean(proc)
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "up", "--simulate", "--kv-cache-dtype", "fp8"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "drop --kv-cache-dtype or --simulate" in done.stderr


def test_kvflow_up_refuses_half_a_disaggregated_pool() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "up", "--prefill-workers", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--decode-workers" in done.stderr


def test_kvflow_up_with_two_simulated_models() -> None:
    names = ["alpha", "beta.v2"]
    args = [a for n in names for a in ("--served-model-name", n)]
    with kvflow_up("--simulate", *args, timeout_s=60) as (proc, output):
        assert "alpha worker 1: ready on 127.0.0.1:" in output
        assert "beta-v2 worker 1: ready on 127.0.0.1:" in output  # its pool's name
        url, _, python = printed_examples(output)
        curls = re.findall(r"^curl .*?}'$", output, re.S | re.M)
        assert [json.loads(run_printed(c))["model"] for c in curls] == names
        printed = run_printed(python).splitlines()
        assert [line.split(" -> ")[0] for line in printed] == names
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == names
        for name in names:
            answer = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert answer.model == name
        stop_and_check_clean(proc)


def test_kvflow_up_refuses_models_that_do_not_pair() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "up", "--model", "a.gguf", "--model", "b.gguf",
         "--served-model-name", "a"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "as many --served-model-name" in done.stderr


def test_kvflow_up_off_loopback_needs_tenants_or_an_explicit_opt_in() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "up", "--simulate", "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--tenants-file" in done.stderr and "--allow-unauthenticated" in done.stderr
    assert time.monotonic() - started < 30  # refused before any worker starts
    # Opting in serves anonymous callers on every address.
    with kvflow_up("--simulate", "--host", "0.0.0.0", "--allow-unauthenticated") as (proc, out):
        url, _, _ = printed_examples(out)
        models = openai.OpenAI(base_url=f"{url}/v1", api_key="x").models.list()
        assert [m.id for m in models.data] == ["smollm2"]
        stop_and_check_clean(proc)


def test_kvflow_up_with_a_tenants_file_asks_for_a_key(tmp_path: Path) -> None:
    from kvflow.router.tenants.config import hash_api_key

    key = "sk-up-0123456789abcdef"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"- {{name: team-a, api_key_sha256: [{hash_api_key(key)}]}}\n")
    with kvflow_up("--simulate", "--host", "0.0.0.0", "--tenants-file", str(tenants)) as (
        proc,
        out,
    ):
        url, _, _ = printed_examples(out)
        assert "Tenants are on" in out and "Authorization: Bearer YOUR_KEY" in out
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        reply = client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
        assert reply.choices[0].text is not None
        stop_and_check_clean(proc)
