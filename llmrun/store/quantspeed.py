"""Which quantization decodes fastest on this CPU, from measured tables: what `llmrun show`
says beside a model's quantization, where a user can choose (`create -q`, a catalog tag).

The tables are scripts/quant_speed.py's on SmolLM2-135M (the raw decode loop, one sequence, 2
threads, each type made from one F16 copy), with llmrun's build of llama.cpp: its patches
repack Q4_1 weights for AVX2 and AVX-512 kernels, and Q8_0 and Q5_0 for AVX-512 VNNI ones
(scripts/llama-patches/0006-0008), which changes the order from stock llama.cpp's (there
Q4_0, repacked, led, and Q4_1 came after Q8_0). Measured 2026-12-05 on an AMD EPYC (Zen 4);
the AVX2 table with the CPU backend built for AVX2 only, on the same machine. A tiny model's
step is bound by the kernels more than by memory, so its ranking is the kernels' and holds
for models of a few hundred million parameters; a large model reads more weights a token,
and there a smaller file gains.
"""

from __future__ import annotations

from pathlib import Path

# CPU class -> (type, decode rate over the fastest's), fastest first
MEASURED: dict[str, list[tuple[str, float]]] = {
    "AVX-512 VNNI": [("Q4_1", 1.00), ("Q5_0", 0.95), ("Q4_0", 0.93), ("Q4_K_M", 0.90),
                     ("Q8_0", 0.84)],
    "AVX2": [("Q4_1", 1.00), ("Q4_0", 0.99), ("Q8_0", 0.81), ("Q4_K_M", 0.79),
             ("Q5_0", 0.74)],
}


def cpu_class(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """This CPU's class in MEASURED (None: another, or not known)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    if "avx512_vnni" in flags and "avx512bw" in flags:
        return "AVX-512 VNNI"
    if "avx2" in flags and "fma" in flags and "f16c" in flags:
        return "AVX2"
    return None


def decode_note(quant: str, cls: str | None) -> str | None:
    """What show says of `quant`'s decode speed on a CPU of class `cls`; None: nothing
    measured there."""
    if cls is None or cls not in MEASURED:
        return None
    table = MEASURED[cls]
    fastest = table[0][0]
    rate = dict(table).get(quant.upper())
    if rate is None:
        return f"not measured; {fastest} decodes fastest on {cls} CPUs"
    if quant.upper() == fastest:
        return f"the fastest measured on {cls} CPUs"
    return f"{rate:.2f}x of {fastest}, the fastest measured on {cls} CPUs"
