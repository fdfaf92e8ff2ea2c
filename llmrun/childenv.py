"""The environment of the processes that parse untrusted model files (runners, the
quantizer child): an allowlist, so that a compromised child finds no credential in it.

The daemon's own environment may hold HF_TOKEN, LLMRUN_API_KEYS, cloud keys, a shell's
tokens...; a child gets only what it needs to start Python and tune llama.cpp.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# Names passed on as they are.
ALLOWED = frozenset({
    "PATH", "HOME",  # HOME: Python finds user site-packages (pip install --user) through it
    "LANG", "LANGUAGE", "TZ", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
    "VK_DRIVER_FILES", "VK_ICD_FILENAMES",  # which Vulkan driver (the loader's choice)
    "MTMD_CPP_LIB",  # llama-cpp-python's libmtmd from elsewhere (beside LLAMA_CPP_LIB_PATH)
    "GLIBC_TUNABLES",  # malloc's settings, e.g. glibc.malloc.hugetlb=1 (docs/benchmarks.md)
    # test-only: the child acts as on a kernel without Landlock (engine/sandbox/landlock.py)
    "LLMRUN_SANDBOX_TEST_NO_LANDLOCK",
})
# Families passed on: locale, the interpreter's own settings, thread and BLAS tuning,
# llama.cpp's variables.
ALLOWED_PREFIXES = ("LC_", "PYTHON", "OMP_", "GOMP_", "KMP_", "GGML_", "LLAMA_", "OPENBLAS_",
                    "MKL_", "BLIS_")
# Whatever the family, a name that looks like a credential stays behind (LLAMA_API_KEY...).
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION", re.IGNORECASE)


def allowed(name: str) -> bool:
    if SECRET.search(name):
        return False
    return name in ALLOWED or name.startswith(ALLOWED_PREFIXES)


def scrubbed(extra: Mapping[str, str] | None = None,
             environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (default: this process's) reduced to the allowlist, then `extra` (the
    LLMRUN_* settings the child reads, given explicitly by the caller)."""
    source = os.environ if environ is None else environ
    env = {k: v for k, v in source.items() if allowed(k)}
    env.update(extra or {})
    return env
