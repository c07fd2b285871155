"""llama-cpp-python's OpenAI server, optionally without llama.cpp's extra buffer types.

Run by ``llamacpp_peer.py`` with the llama.cpp venv's interpreter, in place of
``python -m llama_cpp.server``. With ``--no-extra-bufts`` every model loads with
``use_extra_bufts = false``: no weight repacking into llama.cpp's AMX or AVX buffer
layouts. On an Intel CPU with AMX (Sapphire Rapids, seen with llama-cpp-python 0.3.36 and
the Q4_1 SmolLM2) the first evaluation through those buffers dies with SIGSEGV; without
them llama.cpp runs its ordinary quantized dot products, which is what it did on the AMD
machines this peer was first measured on.

    .venv-llamacpp/bin/python bench/llamacpp_server.py [--no-extra-bufts] SERVER ARGS...
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    if "--no-extra-bufts" in sys.argv:
        sys.argv.remove("--no-extra-bufts")
        import llama_cpp
        import llama_cpp.llama

        defaults = llama_cpp.llama_model_default_params

        def without_extra_bufts() -> object:
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_model_default_params = without_extra_bufts
        llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_bufts
    sys.argv[0] = "llama_cpp.server"
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
