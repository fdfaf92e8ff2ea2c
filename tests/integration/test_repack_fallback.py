"""A CPU without the repacked kernels' instructions takes llama.cpp's ordinary path.

The 8x8 kernels of scripts/llama-patches/0006-0008 are compiled only where the build's
target has AVX2 (Q4_1) or AVX-512 VNNI (Q8_0, Q5_0), and llmrun builds llama.cpp for the CPU
it runs on (scripts/llama-wheel.sh keys its wheel by the CPU's flags). So a CPU without them
gets a library without them. This builds that library: llama.cpp's CPU backend from this
checkout's patched sources for x86-64 with SSE4.2 and nothing newer (no AVX, FMA or F16C),
beside the installed llama.cpp's other libraries, and runs test_repack.py's two checks of
which weights are repacked against it: nothing is taken by these patches, and SmolLM2 and
Gemma 3 decode (no SIGILL), with greedy text equal to llama.cpp's no-repack path.

Building the one library takes about 30 s on 2 cores.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci_groups import inapplicable, needs
from tests.integration.test_repack import patches_missing

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine() in ("x86_64", "AMD64")


def _unavailable() -> str:
    """Why this cannot run here ("": it can): the patched build it takes its libraries
    from, and CMake (which the README asks for) to build the baseline one."""
    if not X86:
        return ""  # inapplicable, not missing: said by the fixture
    if shutil.which("cmake") is None:
        return "CMake is not installed (sudo apt-get install cmake)"
    return patches_missing()


# the installed llama-cpp-python and the test models; in the repack group (tests/ci_groups.py)
pytestmark = [pytest.mark.model, needs("repack", _unavailable)]
VERSION = "0.3.36"
# x86-64 with SSE4.2 only: the oldest CPUs llama.cpp's x86 build variants target
BASELINE = ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=OFF", "-DGGML_AVX2=OFF",
            "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
            "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_FMA=OFF",
            "-DGGML_F16C=OFF", "-DGGML_BMI2=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF"]


@pytest.fixture(scope="module")
def baseline_libs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The installed llama.cpp's libraries, its CPU backend rebuilt for SSE4.2 only."""
    if not X86:
        inapplicable("the patches' kernels are x86 ones")
    work = tmp_path_factory.mktemp("baseline")
    subprocess.run(["bash", str(ROOT / "scripts/llama-sources.sh"), sys.executable, VERSION,
                    str(work)], check=True, capture_output=True)
    src = work / f"llama_cpp_python-{VERSION}" / "vendor/llama.cpp"
    build = work / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                    "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_COMMON=OFF",
                    "-DGGML_BACKEND_DL=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF", *BASELINE],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "ggml-cpu", "-j",
                    str(os.cpu_count() or 2)], check=True, capture_output=True)
    built = next(build.rglob("libggml-cpu.so.*.*"), None)
    assert built is not None, "the CPU backend was not built"
    installed = Path(md.distribution("llama-cpp-python").locate_file("llama_cpp/lib"))
    libs = work / "lib"
    shutil.copytree(installed, libs, symlinks=True)
    target = (libs / "libggml-cpu.so.0").resolve()
    target.unlink()
    shutil.copy2(built, target)  # the sonames' links now lead to the baseline build
    return libs


def test_without_avx2_nothing_is_repacked_and_the_models_decode(baseline_libs: Path) -> None:
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(baseline_libs)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests/integration/test_repack.py"),
         "-k", "path_taken_where_the_cpu_has_the_kernels or gemma_q5_0", "-s", "-c",
         str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out  # (a SIGILL would be -4, or pytest's crash report)
    assert "2 passed" in out, out
    # and the library the child loaded was the baseline one: no AVX2 in its features
    probe = subprocess.run(
        [sys.executable, "-c", "import llama_cpp.llama_cpp as C; "
                               "print(C.llama_print_system_info().decode())"],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert probe.returncode == 0, probe.stderr
    assert "AVX2 = 1" not in probe.stdout and "SSE3 = 1" in probe.stdout, probe.stdout
