"""guidellm, the load generator of the vLLM ecosystem (from PyPI), against `kvflow up
--simulate`: every request it sends must succeed.

guidellm sends vLLM's extensions (`stream_options.continuous_usage_stats` on every
streaming request) and reads usage from the stream; until kvflow accepted them, every one
of its requests was refused with a 400. It lives in its own virtual environment
(`make guidellm`), since its pinned dependencies are not kvflow's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.process import launch_kvflow
from testkit.tokenizer_files import write_smollm2_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GUIDELLM = Path(os.environ.get("KVFLOW_GUIDELLM", REPO / ".venv-guidellm" / "bin" / "guidellm"))


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_runs_against_kvflow_up_without_errors(endpoint: str, tmp_path: Path) -> None:
    assert GUIDELLM.exists(), f"{GUIDELLM} is missing: run `make guidellm` (CI's .ci/run does)"
    tokenizer = write_smollm2_tokenizer(tmp_path / "tokenizer")
    up = launch_kvflow(["up", "--simulate", "--port", "0", "--workers", "2"],
                       ready_prefix="kvflow is running:", timeout_s=120)  # fmt: skip
    try:
        url = re.search(r"(http://\S+)/v1", up.ready_line).group(1)  # type: ignore[union-attr]
        out = tmp_path / "guidellm.json"
        command = [
            str(GUIDELLM), "run",
            "--backend", f"kind=openai_http,target={url},model=smollm2,request_format={endpoint}",
            "--profile", "kind=concurrent,streams=2",
            "--constraint", "kind=max_duration,seconds=4",
            "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}",
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
        done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env,
                              check=False, cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        up.stop()
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == 0, benchmark["requests"].get("errored", [])[:1]
    assert totals["successful"] >= 20, totals
    # Its token counts come from kvflow's streamed usage: the 16 output tokens it asked for.
    outputs = benchmark["metrics"]["output_token_count"]["successful"]
    assert outputs["median"] == 16, outputs


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
