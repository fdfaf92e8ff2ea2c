"""The runner process: one per loaded model, started and supervised by the daemon.

    python -m llmrun.engine.runner --fd N      (the daemon: server/runners.py)
    python -m llmrun.engine.runner --list-devices

It speaks llmrun.protocol over the inherited socket `--fd` (frames of llmrun.ipc): the first
frame is the Load message (which files, how to load them); the runner confines itself to
those files (engine/boot.py), loads the model, answers Ready (or Fatal), then serves requests
(engine/host.py) until the daemon says Shutdown or goes away. `--list-devices` prints the
devices llama.cpp can place layers on, as JSON, and exits (the daemon's server/devices.py and
scripts/gpu_check.sh read it).

A crash here (llama.cpp is C++) takes down only this process; the daemon reports it to the
requests in flight. When the daemon goes away the channel closes and the runner exits.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING

from llmrun import config, ipc, protocol
from llmrun.engine import sandbox
from llmrun.ipc import ChannelClosed, SyncChannel

if TYPE_CHECKING:
    from llmrun.engine.host import ModelHost

# Nothing here imports llama.cpp or numpy at the top: they start threads as they load
# (OpenBLAS's pool), and the runner's first step, entering its namespaces, needs a process
# with one thread. main() imports them after that step.

log = logging.getLogger("llmrun.runner")


def _stop_on_sigterm(chan: SyncChannel) -> None:
    """SIGTERM ends the message loop as a shutdown message does: the engine stops and the
    prompt states being written are finished (ModelHost.serve). It comes from a service
    manager stopping the daemon's whole cgroup (systemd's default), or from the kernel when
    the daemon dies (_die_with_parent); the default action would kill the runner mid-write.
    The handler only closes the channel's reading side, so the loop sees the end of input
    at its next read, wherever the signal found the main thread."""
    def handler(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            chan.sock.shutdown(socket.SHUT_RD)

    signal.signal(signal.SIGTERM, handler)


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when the daemon dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass



def _read_load(chan: SyncChannel) -> protocol.Load | None:
    """The daemon's first message, which must be Load; None (after telling the daemon why,
    where it still listens) when it is not."""
    try:
        msg = protocol.parse_command(chan.recv())
    except (ChannelClosed, OSError) as exc:
        log.error("the daemon closed the channel before saying what to load (%s)", exc)
        return None
    except ValueError as exc:  # not JSON, or not a message (ProtocolError)
        why = f"the first message must load a model: {exc}"
    else:
        if isinstance(msg, protocol.Load):
            return msg
        why = f"the first message must load a model, not {msg.type!r}"
    log.error("%s", why)
    with contextlib.suppress(OSError):
        chan.send(protocol.Fatal(error=why))
    return None


def start(chan: SyncChannel, load: protocol.Load) -> ModelHost | None:
    """Confine this process as `load` calls for and load the model inside the confinement
    (None, after telling the daemon why, when it cannot). The one place a runner's
    confinement is decided: the red-team tests run their payloads after exactly this."""
    isolated: tuple[list[str], list[str]] = ([], [])
    if config.sandbox_mode() != "off":
        # first, while this process has one thread (unshare refuses more); a runner that
        # talks to RPC workers keeps the network it reaches them by
        isolated = sandbox.isolate(keep_network=bool(load.rpc))
    from llmrun.engine.boot import boot

    return boot(chan, load, isolated)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmrun.engine.runner")
    ap.add_argument("--list-devices", action="store_true",
                    help="print the devices llama.cpp can place layers on (JSON) and exit")
    ap.add_argument("--fd", type=int,
                    help="the socket to the daemon, whose first message says what to load")
    args = ap.parse_args(argv)
    if args.list_devices:
        from llmrun.engine.llama import list_backends, list_devices

        print(json.dumps({"devices": list_devices(), "backends": list_backends()}))
        return 0
    if args.fd is None:
        ap.error("--fd is required (or --list-devices)")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s runner %(levelname)s %(message)s")
    # Stops come from the daemon: the runner has a session of its own (server/runners.py),
    # and an interrupt sent to it anyway is not a reason to drop what it is writing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    chan = SyncChannel(socket.socket(fileno=args.fd))
    load = _read_load(chan)
    if load is None:
        return 1
    ipc.MAX_FRAME = load.max_frame  # both sides must agree on the limit
    if load.debug:
        logging.getLogger().setLevel(logging.DEBUG)
    host = start(chan, load)
    if host is None:
        return 1
    _stop_on_sigterm(chan)  # (until here a SIGTERM ends it at once: nothing to keep yet)
    host.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
