"""What `llmrun show` says of a quantization's decode speed (llmrun/store/quantspeed.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmrun.store.quantspeed import MEASURED, cpu_class, decode_note


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\n"
                    f"processor\t: 1\nflags\t\t: {flags}\n")
    return path


@pytest.mark.parametrize("flags, cls", [
    ("fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_vnni", "AVX-512 VNNI"),
    ("fpu sse4_2 avx avx2 fma f16c avx512f", "AVX2"),  # AVX-512 without VNNI
    ("fpu sse4_2 avx avx2 fma f16c", "AVX2"),
    ("fpu sse4_2 avx", None),
    ("fp asimd neon", None),
])
def test_the_cpu_class_comes_from_its_flags(tmp_path: Path, flags: str, cls: str | None) -> None:
    assert cpu_class(cpuinfo(tmp_path, flags)) == cls


def test_no_cpuinfo_no_class(tmp_path: Path) -> None:
    assert cpu_class(tmp_path / "missing") is None


def test_the_note_names_the_fastest_and_the_rate() -> None:
    assert decode_note("Q4_1", "AVX-512 VNNI") == "the fastest measured on AVX-512 VNNI CPUs"
    assert decode_note("q8_0", "AVX-512 VNNI") == \
        "0.84x of Q4_1, the fastest measured on AVX-512 VNNI CPUs"
    assert decode_note("Q6_K", "AVX2") == "not measured; Q4_1 decodes fastest on AVX2 CPUs"
    assert decode_note("Q4_1", None) is None


def test_each_table_is_fastest_first() -> None:
    for table in MEASURED.values():
        rates = [rate for _, rate in table]
        assert rates[0] == 1.0 and rates == sorted(rates, reverse=True)
