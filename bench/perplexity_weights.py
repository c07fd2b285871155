"""Perplexity of the built-in GGUF three ways: kvflow's quantized weights, widened, llama.cpp.

Issue 33's quality target for keeping a GGUF's weights quantized: perplexity on a fixed
English text within 1 % of llama.cpp's on the same file. Arms, on the same token ids (the
text of ``bench/perplexity.py``, tokenized once by SmolLM2's tokenizer):

  kvflow          the engine as a worker runs it (``--quantization auto``: 4-bit planes,
                  int4 kernels; the text in chunks of 512, each attending to the earlier ones
                  through the paged cache, as prefill does)
  kvflow-widened  the same with ``--quantization none`` (the GGUF widened to float32)
  llama.cpp       llama-cpp-python (``make llamacpp``) evaluating the same ids in one
                  context with every position's logits (``logits_all``); without its extra
                  buffer types on AMX CPUs, where they crash (``llamacpp_server.py``)

Each is ``exp`` of the mean negative log-likelihood of every token given those before it.

    python bench/perplexity_weights.py [--max-tokens N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from llamacpp_peer import has_amx  # noqa: E402
from perplexity import TEXT, cpu_model, in_thread, log, score, tokenize  # noqa: E402

from kvflow.engine_worker.model.default_model import default_model_path  # noqa: E402
from kvflow.engine_worker.model.loader import load_model  # noqa: E402

LLAMACPP_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
# Run by the llama.cpp venv's interpreter: the NLL of each token after the first.
_LLAMACPP_SCRIPT = """
import json, sys
import numpy as np
import llama_cpp, llama_cpp.llama
model, ids_path, out_path, no_extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if no_extra:
    defaults = llama_cpp.llama_model_default_params
    def params():
        p = defaults(); p.use_extra_bufts = False; return p
    llama_cpp.llama_model_default_params = params
    llama_cpp.llama.llama_cpp.llama_model_default_params = params
ids = json.load(open(ids_path))
llm = llama_cpp.Llama(model_path=model, n_ctx=len(ids) + 16, n_batch=512, n_threads=1,
                      logits_all=True, verbose=False)
llm.eval(ids)
logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
logits -= logits.max(axis=1, keepdims=True)
logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
nll = -logp[np.arange(len(ids) - 1), ids[1:]]
json.dump({"nll": nll.tolist(), "argmax": logits.argmax(axis=1).tolist()}, open(out_path, "w"))
"""


def llamacpp_nll(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    if not LLAMACPP_PYTHON.exists():
        raise SystemExit(f"{LLAMACPP_PYTHON} not found: `make llamacpp` installs it")
    with tempfile.TemporaryDirectory() as tmp:
        ids, out = Path(tmp) / "ids.json", Path(tmp) / "out.json"
        ids.write_text(json.dumps(tokens))
        subprocess.run(
            [str(LLAMACPP_PYTHON), "-c", _LLAMACPP_SCRIPT, str(default_model_path()), str(ids),
             str(out), "1" if has_amx() else "0"],
            check=True,
        )  # fmt: skip
        result = json.loads(out.read_text())
    return torch.tensor(result["nll"], dtype=torch.float64), torch.tensor(result["argmax"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, help="score only the text's first N tokens")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    tokens = tokenize(TEXT.read_text())[: args.max_tokens]
    arms: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for name, quantization in (("kvflow", "auto"), ("kvflow-widened", "none")):
        log(f"{name}: --quantization {quantization}")
        loaded = load_model(None, quantization=quantization)
        started = time.perf_counter()
        nll, choice, _ = in_thread(lambda loaded=loaded: score(loaded, "auto", tokens, 512))
        arms[name] = (nll, choice, time.perf_counter() - started)
    log("llama.cpp")
    started = time.perf_counter()
    nll, choice = llamacpp_nll(tokens)
    arms["llama.cpp"] = (nll, choice, time.perf_counter() - started)

    ref_nll, ref_choice, _ = arms["llama.cpp"]
    results: dict[str, Any] = {}
    print(f"\nperplexity on {TEXT.relative_to(ROOT)} ({len(tokens)} tokens), SmolLM2 Q4_1")
    print(f"{'arm':<15} {'perplexity':>10} {'vs llama.cpp':>12} {'argmax = llama.cpp':>18}")
    for name, (nll, choice, seconds) in arms.items():
        ppl = math.exp(nll.mean().item())
        row = {
            "perplexity": ppl,
            "mean_nll": nll.mean().item(),
            "ratio_vs_llamacpp": ppl / math.exp(ref_nll.mean().item()),
            "argmax_agreement_vs_llamacpp": (choice == ref_choice).double().mean().item(),
            "max_abs_nll_diff_vs_llamacpp": (nll - ref_nll).abs().max().item(),
            "seconds": seconds,
        }
        results[name] = row
        print(
            f"{name:<15} {ppl:>10.4f} {row['ratio_vs_llamacpp']:>12.4f} "
            f"{100 * row['argmax_agreement_vs_llamacpp']:>17.1f}%"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads()},
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv),
            "text": str(TEXT.relative_to(ROOT)),
            "num_tokens": len(tokens),
            "llamacpp_extra_bufts": not has_amx(),
            "arms": results,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
