"""Repacked Q4_1 and Q8_0 weights (scripts/llama-patches/0006, 0007) against llama.cpp's
ordinary kernels, in the same build: SmolLM2's shipped file (Q4_1, its output matrix Q8_0)
loaded twice, with `use_extra_bufts` true (weights repacked at load into 8-row blocks, the
8x8 GEMV/GEMM kernels) and false (llama-server's --no-repack: ggml_vec_dot_q4_1_q8_1 and
ggml_vec_dot_q8_0_q8_0 row by row).

Both paths multiply the same weights by the same Q8_1 / Q8_0 activations (the ordinary
path's own quantizers); the integer sums of 4 adjacent values are exact, and the patches'
kernels add the float sums in the order of ggml_vec_dot_q4_1_q8_1 and ggml_vec_dot_q8_0_q8_0
(their AVX2 forms), so the logits are the same to the
bit: the bound stated and tested is zero. (A kernel that summed in another order measured
logit differences up to 1.0 on this model, greedy text diverging on 4 of the 5 prompts below
within 32 tokens: a last-bit change flips the rounding of an activation quantized for the
next layer, and 30 layers grow it. Bit-identity is the bound that keeps greedy text.)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import logging
import math
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.ci_groups import inapplicable, needs

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def patches_missing() -> str:
    """Why the installed llama.cpp is not one built with this checkout's patches ("": it
    is). scripts/llama-wheel.sh writes llama_cpp/.llmrun-safe-build beside the library it
    installs: the library's sha256 and `patches=` the digest of the patches it was built
    with. A stock wheel has no such file; a wheel installed over it (pip --force-reinstall)
    changes the library's hash; a wheel from older patches names another digest."""
    want = subprocess.run(["bash", str(ROOT / "scripts/llama-sources.sh"), "--digest"],
                          capture_output=True, text=True, check=True).stdout.strip()
    remedy = "`make install` builds it (scripts/llama-wheel.sh)"
    try:
        dist = md.distribution("llama-cpp-python")
        fields = Path(str(dist.locate_file("llama_cpp/.llmrun-safe-build"))).read_text().split()
        lib = Path(str(dist.locate_file("llama_cpp/lib/libggml-cpu.so"))).read_bytes()
    except (md.PackageNotFoundError, OSError) as e:
        return f"llama-cpp-python was not installed by scripts/llama-wheel.sh ({e}): {remedy}"
    if fields[:1] != [hashlib.sha256(lib).hexdigest()]:
        return f"the installed libggml-cpu.so is not the one scripts/llama-wheel.sh built: {remedy}"
    if f"patches={want}" not in fields:
        built = next((f for f in fields if f.startswith("patches=")), "no patches= field")
        return (f"the installed llama.cpp was built with {built}, not this checkout's "
                f"scripts/llama-patches (patches={want}): {remedy}")
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags (/proc/cpuinfo): what says a kernel's instructions are missing here,
    whatever a build was told."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


# the installed llama-cpp-python and a test model; and llmrun's patches in that build: a wheel
# without them fails these tests (tests/ci_groups.py), unless LLMRUN_TEST_SKIP=repack
pytestmark = [pytest.mark.model, needs("repack", patches_missing)]

# measured on the 2-core AMD EPYC (Zen 4, AVX-512 VNNI), 2 threads: identical (0 and 0)
MAX_ABS_LOGIT_DIFF = 0.0
MAX_PPL_REL_DIFF = 0.001  # 0.1% (measured: 0)

PROMPT = ("The lighthouse keeper climbed the stairs at dusk, as he had every evening for "
          "thirty years, and found on the top step a bottle with a letter inside. It read:")
GREEDY_PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "List three uses of a paperclip.",
    "Explain what a CPU cache is to a child.",
    "def fibonacci(n):",
]
GREEDY_TOKENS = 32


@dataclass
class Loaded:
    model: int
    ctx: int
    n_vocab: int


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _load(path: Path, repack: bool) -> tuple[Loaded, list[str]]:
    """The model and a context, the weights repacked at load or not; and llama.cpp's log of
    the load (llmrun routes it to the `llmrun.llama` logger)."""
    import llama_cpp.llama_cpp as C

    from llmrun.engine.llama.lib import init_backend

    init_backend()
    logger = logging.getLogger("llmrun.llama")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        mp = C.llama_model_default_params()
        mp.use_extra_bufts = repack
        model = C.llama_model_load_from_file(str(path).encode(), mp)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert model, f"llama.cpp could not load {path}"
    cp = C.llama_context_default_params()
    cp.n_ctx = 1024
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = 2
    cp.no_perf = True
    ctx = C.llama_init_from_model(model, cp)
    assert ctx
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    return Loaded(model, ctx, n_vocab), handler.lines


@pytest.fixture(scope="module")
def pair(smollm2_path: Path) -> Iterator[tuple[Loaded, Loaded, list[str]]]:
    """(repacked, ordinary, the repacked load's log)."""
    import llama_cpp.llama_cpp as C

    repacked, log = _load(smollm2_path, True)
    ordinary, _ = _load(smollm2_path, False)
    yield repacked, ordinary, log
    for m in (repacked, ordinary):
        C.llama_free(m.ctx)
        C.llama_model_free(m.model)


def _repack_taken(log: list[str]) -> bool:
    # llama.cpp names each buffer of the model's weights at load: "CPU_REPACK model buffer
    # size = ..." when some weights went to the repacked buffer type
    return any("CPU_REPACK model buffer size" in line for line in log)


@pytest.fixture(scope="module")
def repacked_pair(pair: tuple[Loaded, Loaded, list[str]]) -> tuple[Loaded, Loaded]:
    repacked, ordinary, log = pair
    if "avx2" not in cpu_flags():
        inapplicable("this CPU has no AVX2, which the Q4_1 8x8 kernels (patch 0006) need: "
                     "nothing is repacked, nothing to compare")
    # the patches are in the build (the group's check) and the CPU has AVX2: the weights
    # must have been repacked; not taken is a broken build (not native, or a patch lost)
    import llama_cpp.llama_cpp as C

    assert _repack_taken(log), ("Q4_1 weights not repacked on a CPU with AVX2",
                                C.llama_print_system_info().decode())
    return repacked, ordinary


def _tokens(m: Loaded, text: str) -> list[int]:
    import llama_cpp.llama_cpp as C

    raw = text.encode()
    buf = (C.llama_token * (len(raw) + 8))()
    n = C.llama_tokenize(C.llama_model_get_vocab(m.model), raw, len(raw), buf, len(buf),
                         True, True)
    assert n > 0
    return list(buf[:n])


def _logits(m: Loaded, toks: list[int], pos0: int = 0, every: bool = True) -> np.ndarray:
    """Logits of one decode of `toks` at positions pos0..: every row, or the last only."""
    import llama_cpp.llama_cpp as C

    if pos0 == 0:
        C.llama_memory_clear(C.llama_get_memory(m.ctx), True)
    batch = C.llama_batch_init(len(toks), 0, 1)
    try:
        batch.n_tokens = len(toks)
        for i, t in enumerate(toks):
            batch.token[i] = t
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = every or i == len(toks) - 1
        assert C.llama_decode(m.ctx, batch) == 0
        rows = range(len(toks)) if every else [len(toks) - 1]
        return np.stack([np.ctypeslib.as_array(C.llama_get_logits_ith(m.ctx, i),
                                               shape=(m.n_vocab,)).copy() for i in rows])
    finally:
        C.llama_batch_free(batch)


def _greedy(m: Loaded, prompt: str, n: int) -> list[int]:
    toks = _tokens(m, prompt)
    nxt = int(_logits(m, toks, every=False)[-1].argmax())
    out = [nxt]
    for k in range(n - 1):
        nxt = int(_logits(m, [nxt], len(toks) + k, every=False)[-1].argmax())
        out.append(nxt)
    return out


def _perplexity(m: Loaded, toks: list[int]) -> float:
    logits = _logits(m, toks).astype(np.float64)
    shifted = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    nll = -logp[np.arange(len(toks) - 1), toks[1:]]
    return math.exp(float(nll.mean()))


def test_repacked_path_taken_where_the_cpu_has_the_kernels(
        pair: tuple[Loaded, Loaded, list[str]]) -> None:
    import llama_cpp.llama_cpp as C

    repacked, ordinary, log = pair
    info = C.llama_print_system_info().decode()
    if "AVX2 = 1" not in info:
        # the fallback: without the kernels' instructions (checked with a build of these
        # sources for SSE3 only) nothing is repacked by these patches and the model decodes
        # through llama.cpp's ordinary path, no SIGILL
        assert not any("with q4_1_8x8" in line or "with q8_0_8x8" in line for line in log)
        assert _greedy(repacked, GREEDY_PROMPTS[0], 8) == _greedy(ordinary, GREEDY_PROMPTS[0], 8)
        return
    # the patches are in the build (the group's check): an AVX2 build repacks
    assert _repack_taken(log), info
    assert any("with q4_1_8x8" in line for line in log)
    # patch 0007: the output matrix (the tied token embedding, Q8_0) where AVX-512 VNNI is
    assert any("token_embd.weight with q8_0_8x8" in line for line in log) == (
        "AVX512_VNNI = 1" in info)


def test_prompt_logits_within_bound_and_argmax_equal(
        repacked_pair: tuple[Loaded, Loaded]) -> None:
    # a prompt of more than 4 rows takes the GEMM kernel (4 activation rows at a time) and
    # the GEMV for the rest (34 tokens: 8 GEMM passes and 2 GEMV rows)
    repacked, ordinary = repacked_pair
    toks = _tokens(repacked, PROMPT)
    a, b = _logits(repacked, toks), _logits(ordinary, toks)
    assert np.isfinite(a).all()
    assert float(np.abs(a - b).max()) <= MAX_ABS_LOGIT_DIFF
    assert (a.argmax(axis=1) == b.argmax(axis=1)).all()


def test_greedy_text_equal(repacked_pair: tuple[Loaded, Loaded]) -> None:
    # one token per decode: the GEMV kernel
    repacked, ordinary = repacked_pair
    for prompt in GREEDY_PROMPTS:
        assert _greedy(repacked, prompt, GREEDY_TOKENS) == _greedy(ordinary, prompt,
                                                                   GREEDY_TOKENS), prompt


def test_perplexity_unchanged_within_a_tenth_of_a_percent(
        repacked_pair: tuple[Loaded, Loaded]) -> None:
    repacked, ordinary = repacked_pair
    text = (ROOT / "README.md").read_text(encoding="utf-8")[:1500]
    toks = _tokens(repacked, text)[:400]
    assert len(toks) >= 200
    p_repacked, p_ordinary = _perplexity(repacked, toks), _perplexity(ordinary, toks)
    assert math.isfinite(p_repacked)
    assert abs(p_repacked / p_ordinary - 1) <= MAX_PPL_REL_DIFF, (p_repacked, p_ordinary)


def test_gemma_q5_0_and_q8_0_tensors_repacked_where_avx512_vnni(gemma3_path: Path) -> None:
    # patch 0008 (Q5_0) and 0007 (Q8_0): Gemma 3 270M's Q4_K_M file holds 81 Q5_0 tensors and
    # 10 Q8_0 (its output matrix among them). Their sums are the ordinary kernels' to the bit
    # (checked per matrix product when the patches were made); Gemma's logits cannot show it
    # against --no-repack, which also turns off llama.cpp's own Q4_K repack, whose sums run
    # in another order than vec_dot_q4_K_q8_K's. Here: the tensors are taken, and it decodes.
    import llama_cpp.llama_cpp as C

    info = C.llama_print_system_info().decode()
    gemma, log = _load(gemma3_path, True)
    try:
        q5 = sum("with q5_0_8x8" in line for line in log)
        q8 = sum("with q8_0_8x8" in line for line in log)
        if "AVX512_VNNI = 1" not in info:
            assert q5 == q8 == 0
            return
        # patch 0008 is in the build (the group's check): none taken is a failure
        assert (q5, q8) == (81, 10)
        assert np.isfinite(_logits(gemma, _tokens(gemma, PROMPT), every=False)).all()
    finally:
        C.llama_free(gemma.ctx)
        C.llama_model_free(gemma.model)
