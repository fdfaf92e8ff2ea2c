"""What the sandbox probes share: each attempt's outcome, "ok" or how it failed (the name of
its errno, or an exception's type), for tests/fakes/confined_payload.py and the probes of
tests/integration/test_sandbox.py."""

from __future__ import annotations

import errno
from collections.abc import Callable


def tried(attempts: dict[str, Callable[[], object]]) -> dict[str, str]:
    results = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            results[name] = "ok"
        except OSError as exc:
            results[name] = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        except Exception as exc:  # MemoryError, RuntimeError (a thread refused)
            results[name] = type(exc).__name__
    return results
