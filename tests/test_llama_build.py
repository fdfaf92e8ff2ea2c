"""The llama.cpp the engine runs is the build scripts/llama-wheel.sh made: AMX off, and
llmrun's patches to llama.cpp (scripts/llama-patches) applied, the ones in this checkout."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.model  # needs the installed llama-cpp-python

ROOT = Path(__file__).resolve().parent.parent


def test_the_installed_llama_cpp_is_the_safe_build_with_this_checkouts_patches() -> None:
    dist = md.distribution("llama-cpp-python")
    marker = Path(dist.locate_file("llama_cpp/.llmrun-safe-build"))
    assert marker.exists(), "llama-cpp-python was not installed by scripts/llama-wheel.sh"
    fields = marker.read_text().split()
    lib = Path(dist.locate_file("llama_cpp/lib/libggml-cpu.so"))
    # the library is the one the script installed (not a later default build over it)
    assert fields[0] == hashlib.sha256(lib.read_bytes()).hexdigest()
    digest = subprocess.run(["bash", str(ROOT / "scripts/llama-sources.sh"), "--digest"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert f"patches={digest}" in fields, (
        "the installed llama.cpp was built with other patches than scripts/llama-patches "
        "holds: run `make install`")

