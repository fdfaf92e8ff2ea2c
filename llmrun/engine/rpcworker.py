"""`llmrun rpc-worker`: this machine's CPU as a device other hosts' runners place layers on,
through llama.cpp's RPC backend (its own server, in llama-cpp-python's library: no separate
C++ build). A runner given the worker (LLMRUN_RPC_WORKERS) sends it the layers it holds and
the tensors to compute each step.

llama.cpp's RPC protocol has no authentication and no encryption: anyone who reaches the
port can run computations and read what is sent. So the worker binds loopback unless told
otherwise, and refuses an address other hosts can reach without `--insecure`; keep such a
worker on a private network (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from llmrun import config
from llmrun.engine.llama import LlamaError, rpc_serve

log = logging.getLogger("llmrun.rpc-worker")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmrun rpc-worker",
                                 description="Serve this machine's CPU to other hosts' llmrun "
                                             "runners (llama.cpp RPC).")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    ap.add_argument("--port", type=int, default=50052)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="threads computing the layers placed here")
    ap.add_argument("--insecure", action="store_true",
                    help="allow an address other hosts can reach (the protocol has no "
                         "authentication: private networks only)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s rpc-worker %(levelname)s %(message)s")
    if not config.is_loopback(args.host.strip("[]")) and not args.insecure:
        log.error("%s is reachable from other hosts, and llama.cpp's RPC protocol has no "
                  "authentication: pass --insecure to serve it there anyway, on a private "
                  "network only", args.host)
        return 2
    if not 0 < args.port < 65536 or args.threads < 1:
        log.error("--port must be 1-65535 and --threads at least 1")
        return 2
    endpoint = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
    log.info("serving this CPU (%d threads) at %s", args.threads, endpoint)
    try:
        rpc_serve(endpoint, args.threads)
    except LlamaError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
