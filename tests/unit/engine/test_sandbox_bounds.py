"""What the sandbox bounds without a model: the file size each confined process may grow
(RLIMIT_FSIZE), and that setpriority is allowed only on the caller's own thread."""

from __future__ import annotations

import resource
import subprocess
import sys

from llmrun.engine.sandbox import limits, syscalls
from llmrun.engine.sandbox.limits import Limits


def test_a_runner_with_nothing_to_write_may_grow_no_file() -> None:
    assert Limits.for_runner(1 << 30, 4, on_gpu=False, own_user_namespace=True).file_size == 0


def test_a_runner_with_a_prompt_cache_may_grow_one_state_and_no_more() -> None:
    bound = Limits.for_runner(1 << 30, 4, on_gpu=False, own_user_namespace=True,
                              prompt_cache=4 << 30, ctx=8192).file_size
    assert bound == (4 << 30) + 4 * 8192 + limits.STATE_FILE_HEADROOM


def test_a_gpu_runner_has_no_file_size_limit_and_says_why() -> None:
    gpu = Limits.for_runner(0, 4, on_gpu=True, own_user_namespace=True, prompt_cache=1 << 20)
    assert gpu.file_size is None and limits.FILE_SIZE in gpu.unbounded


def test_the_quantizers_output_may_grow_to_its_sources_size_and_headroom() -> None:
    assert Limits.for_quantizer(1000).file_size == 1000 + limits.QUANTIZED_HEADROOM


PAST_THE_LIMIT = """
import errno, os, resource, sys, tempfile
from llmrun.engine.sandbox.limits import Limits, apply
applied, _ = apply(Limits(None, 128, None, file_size=4096))
with tempfile.TemporaryFile() as fh:
    fh.write(b"x" * 4096)
    fh.flush()
    try:
        os.write(fh.fileno(), b"y")
    except OSError as exc:
        print(" ".join(applied), errno.errorcode[exc.errno], resource.getrlimit(
            resource.RLIMIT_FSIZE)[1])
"""


def test_a_write_past_the_file_size_limit_fails_with_efbig_and_the_process_lives() -> None:
    out = subprocess.run([sys.executable, "-c", PAST_THE_LIMIT], capture_output=True,
                         text=True, timeout=60, check=True)
    layers, code, hard = out.stdout.rsplit(None, 2)
    assert limits.FILE_SIZE in layers.split() and code == "EFBIG" and int(hard) == 4096
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY  # (not ours)


def test_setpriority_is_conditional_never_allowed_whatever_its_arguments() -> None:
    every = syscalls.allowed_names(fs_changes=True, gpu=True)
    assert "setpriority" not in every and "setpriority" in syscalls.CONDITIONAL
