"""Which int4 kernels a CPU gets: kvflow's GEMV or torch's, and from how many rows of
activations the product widens the weights for a GEMM instead (``int4_weight``), decided
from the CPU's flags and the environment."""

from __future__ import annotations

import pytest

from kvflow.engine_worker.model.quant import int4_weight, native

_USE_NATIVE_GEMV = int4_weight.use_native_gemv  # the cached choice, under any monkeypatch


@pytest.mark.parametrize(
    ("flags", "choice", "expected"),
    [
        ("avx2 fma", "kvflow", True),  # an AVX2 CPU: kvflow's
        ("avx2 fma avx512f avx512bw", "kvflow", True),  # AVX512: its 512-bit loop
        ("avx2 fma avx512f", "torch", False),  # torch's, asked for
        ("sse4_2", "kvflow", False),  # no AVX2: kvflow's cannot run
    ],
)
def test_the_int4_gemv_choice_follows_the_cpu_and_the_environment(
    flags: str, choice: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(int4_weight, "_cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.setenv(int4_weight.INT4_GEMV_ENV, choice)
    _USE_NATIVE_GEMV.cache_clear()
    try:
        assert _USE_NATIVE_GEMV() is expected
    finally:
        _USE_NATIVE_GEMV.cache_clear()


@pytest.mark.parametrize(
    ("flags", "rows"),
    [
        ("avx2 fma avx512f avx512bw avx512_bf16 amx_bf16", 48),  # AMX's GEMMs: widen early
        ("avx2 fma avx512f avx512bw avx512_bf16", 128),  # a Zen 4: the GEMV wins to ~100
        ("avx2 fma", 128),  # float32 GEMMs
    ],
)
def test_widening_starts_where_the_cpus_gemm_overtakes_the_gemv(
    flags: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(int4_weight, "_cpu_flags", lambda: frozenset(flags.split()))
    int4_weight._widen_min_rows.cache_clear()
    try:
        assert native.native_widener() is not None, "this machine has a C compiler: cc"
        assert int4_weight._widen_min_rows() == rows
    finally:
        int4_weight._widen_min_rows.cache_clear()


def test_an_unknown_int4_gemv_choice_says_what_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(int4_weight.INT4_GEMV_ENV, "fast")
    _USE_NATIVE_GEMV.cache_clear()
    try:
        with pytest.raises(ValueError, match="use kvflow or torch"):
            _USE_NATIVE_GEMV()
    finally:
        _USE_NATIVE_GEMV.cache_clear()
