"""Responses kept for `previous_response_id` (OpenAI's Responses API with `store: true`).

Each response is one JSON file under `LLMRUN_HOME/responses/`: the response object, the input
items of its own request and the id of the response it continued. A conversation is rebuilt
by following those ids, so a long one costs a file per turn, not its whole history per turn.
Files are written atomically and 0600 (they hold what users typed); they expire after
MAX_AGE and at most MAX_COUNT are kept, the oldest removed first. Ids are checked against
their pattern before they name a file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_AGE = 30 * 24 * 3600.0  # seconds a stored response is kept (OpenAI keeps them 30 days)
MAX_COUNT = 10_000
MAX_CHAIN = 1_000  # turns followed back through previous_response_id
PRUNE_EVERY = 100  # saves between scans for expired and surplus files
_ID = re.compile(r"resp_[0-9a-f]{32}")


def new_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


class NotStored(LookupError):
    """No stored response has this id (never stored, deleted or expired)."""


class ResponseStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._saves = 0

    def _path(self, response_id: str) -> Path:
        if not _ID.fullmatch(response_id):
            raise NotStored(response_id)
        return self.directory / f"{response_id}.json"

    def save(self, response: dict[str, Any], input_items: list[dict[str, Any]],
             previous: str | None) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self._path(response["id"])
        data = json.dumps({"response": response, "input": input_items, "previous": previous},
                          ensure_ascii=False).encode()
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")  # 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._saves += 1
        if self._saves % PRUNE_EVERY == 1:  # a scan of the directory: not on every turn
            self._prune()

    def load(self, response_id: str) -> dict[str, Any]:
        path = self._path(response_id)
        try:
            if time.time() - path.stat().st_mtime > MAX_AGE:
                path.unlink(missing_ok=True)
                raise NotStored(response_id)
            record = json.loads(path.read_bytes())
        except (OSError, ValueError):
            raise NotStored(response_id) from None
        if not isinstance(record, dict) or not isinstance(record.get("response"), dict):
            raise NotStored(response_id)
        return record

    def get(self, response_id: str) -> dict[str, Any]:
        return self.load(response_id)["response"]

    def input_items(self, response_id: str) -> list[dict[str, Any]]:
        return list(self.load(response_id).get("input") or [])

    def delete(self, response_id: str) -> None:
        path = self._path(response_id)
        try:
            path.unlink()
        except FileNotFoundError:
            raise NotStored(response_id) from None

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """Every item of the conversation that response `response_id` ended: each earlier
        turn's input then output, oldest first (what OpenAI feeds the next turn; instructions
        are not carried over)."""
        turns: list[list[dict[str, Any]]] = []
        current: str | None = response_id
        while current is not None:
            if len(turns) >= MAX_CHAIN:
                raise NotStored(f"{response_id} (a conversation over {MAX_CHAIN} turns)")
            record = self.load(current)
            output = record["response"].get("output") or []
            turns.append([*(record.get("input") or []), *output])
            previous = record.get("previous")
            current = previous if isinstance(previous, str) else None
        return [item for turn in reversed(turns) for item in turn]

    def _prune(self) -> None:
        """Drop expired files, then the oldest beyond MAX_COUNT."""
        with self._lock:
            now = time.time()
            files = []
            for path in self.directory.glob("resp_*.json"):
                try:
                    mtime = path.stat().st_mtime
                except OSError:
                    continue
                if now - mtime > MAX_AGE:
                    path.unlink(missing_ok=True)
                else:
                    files.append((mtime, path))
            files.sort()
            for _, path in files[: max(0, len(files) - MAX_COUNT)]:
                path.unlink(missing_ok=True)
