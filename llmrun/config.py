"""Settings: `LLMRUN_*` environment variables, then `LLMRUN_HOME/config.yaml`, then defaults.

Every setting is declared once in `SETTINGS` with its default and a description; `llmrun serve
--help` prints that table. A value that does not parse warns and falls back to the default, so
a typo in the environment never stops the daemon from starting.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import platformdirs

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PORT = 11434


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    description: str


SETTINGS: list[Setting] = [
    Setting("LLMRUN_HOME", "", "All state: model store, logs, pid/lock files, config.yaml"),
    Setting("LLMRUN_HOST", f"127.0.0.1:{DEFAULT_PORT}",
            "Address the daemon binds and the CLI uses"),
    Setting("LLMRUN_KEEP_ALIVE", "5m", "How long an idle model stays loaded"),
    Setting("LLMRUN_NUM_PARALLEL", "4", "Sequences decoded together per model (slots)"),
    Setting("LLMRUN_MAX_LOADED_MODELS", "2", "Models held in memory at once"),
    Setting("LLMRUN_MAX_QUEUE", "64", "Requests waiting for a slot before 503"),
    Setting("LLMRUN_CONTEXT_LENGTH", "0",
            "Default context per request (num_ctx); 0 = by memory: on a GPU 4k, 32k or "
            "256k by its size, on a CPU what free memory holds; never past the model's own"),
    Setting("LLMRUN_NUM_THREADS", "0",
            "Decode threads per model (0 = all cores, fewer while other processes use some)"),
    Setting("LLMRUN_API_KEYS", "", "Comma-separated keys required when set"),
    Setting("LLMRUN_ORIGINS", "", "Extra allowed browser origins, comma-separated"),
    Setting("LLMRUN_SANDBOX", "1",
            "Confine model runners (Landlock, seccomp, no new privileges): 1 confines what "
            "the kernel allows and warns once about the rest, strict refuses to run a "
            "model unconfined, 0 turns it off"),
    Setting("LLMRUN_MAX_BODY_SIZE", "32MiB",
            "Largest request body (413 past it); blob uploads have their own limit"),
    Setting("LLMRUN_MAX_BLOB_SIZE", "512GiB",
            "Largest blob uploaded to /api/blobs or pulled from a hub"),
    Setting("LLMRUN_MAX_MESSAGES", "4096", "Most messages in one chat request"),
    Setting("LLMRUN_MAX_STOP", "16", "Most stop strings in one request"),
    Setting("LLMRUN_MAX_IMAGES", "16", "Most images in one request"),
    Setting("LLMRUN_MAX_IMAGE_SIZE", "20MiB", "Largest image in a request (its file, decoded)"),
    Setting("LLMRUN_MAX_AUDIO", "32",
            "Most sound files in one request (a realtime utterance sends one a second)"),
    Setting("LLMRUN_MAX_AUDIO_SIZE", "25MiB",
            "Largest sound file in a request (decoded from base64; OpenAI's limit)"),
    Setting("LLMRUN_IMAGE_URLS", "0",
            "Fetch images that requests name by http(s) URL (1); off, only inline images "
            "(base64, data: URLs) are taken, so no request can make the daemon connect to "
            "another host"),
    Setting("LLMRUN_RATE_LIMIT", "0",
            "Requests per minute per API key (or client address), 429 past it; 0 = off"),
    Setting("LLMRUN_REALTIME_SESSIONS", "8",
            "Realtime transcription sessions (WebSockets on /v1/realtime) open at once"),
    Setting("LLMRUN_REALTIME_SESSIONS_PER_CLIENT", "4",
            "Of those, how many one API key (or client address, without keys) may hold"),
    Setting("LLMRUN_REALTIME_RATE", "100",
            "Events a second one realtime session may send (a burst of twice that); past "
            "it the session is closed; 0 = no limit"),
    Setting("LLMRUN_REALTIME_MAX_AUDIO", "1h",
            "Sound one realtime session may be sent in all (as 600s, 30m, 1h); past it the "
            "session is closed"),
    Setting("LLMRUN_KV_CACHE_TYPE", "f16",
            "KV cache element type: f16, q8_0 (about half the memory) or q4_0 (about a "
            "quarter); a Modelfile's or request's kv_cache_type wins"),
    Setting("LLMRUN_FLASH_ATTENTION", "auto",
            "Flash attention: auto (where the backend has it), on or off; a Modelfile's or "
            "request's flash_attention wins"),
    Setting("LLMRUN_PROMPT_CACHE_SIZE", "4GiB",
            "Disk kept for the KV state of long prompts (agents' system prompts and tools), "
            "so a later session, a restarted daemon or a reloaded model reads them at once; "
            "0 = off"),
    Setting("LLMRUN_PROMPT_CACHE_RAM", "512MiB",
            "Of those states, how much each loaded model also keeps in memory"),
    Setting("LLMRUN_PROMPT_CACHE_MIN_TOKENS", "1024",
            "Prompt tokens a request must read before its state is kept"),
    Setting("LLMRUN_UPSTREAM_PARALLEL", "4",
            "Requests one remote model (FROM http(s)://) runs on its server at once; more "
            "wait, up to LLMRUN_MAX_QUEUE"),
    Setting("LLMRUN_UPSTREAM_TIMEOUT", "300",
            "Seconds a remote model's server may go silent while answering"),
    Setting("LLMRUN_REMOTE_KEYS", "",
            "The API keys remote models may send, name=ENV_VAR comma-separated: a "
            "Modelfile's PARAMETER remote_key name sends that variable's value; no other "
            "variable is ever sent"),
    Setting("LLMRUN_REMOTE_CREATE", "0",
            "1: /api/create over HTTP may create remote models (FROM http(s)://), which make "
            "this daemon connect where the caller says; `llmrun create` on this machine "
            "always may"),
    Setting("LLMRUN_REMOTE_LINK_LOCAL", "0",
            "1: remote models may connect to link-local addresses (169.254.0.0/16, "
            "fe80::/10), cloud metadata services among them"),
    Setting("LLMRUN_RPC_WORKERS", "",
            "llama.cpp RPC workers (llmrun rpc-worker) whose CPUs hold a share of every "
            "model's layers, host:port comma-separated; a Modelfile's num_gpu says how many "
            "layers go to them (default: all; local GPUs are then not used)"),
    Setting("LLMRUN_RPC_SPLIT", "",
            "The workers' shares of the layers, comma-separated (3,1); default: by their "
            "free memory"),
    Setting("LLMRUN_GPUS", "",
            "The GPUs models may use, by llama.cpp's names or their index among the GPUs, "
            "comma-separated (CUDA0,Vulkan1 or 0,2); empty: all; none: the CPU alone"),
    Setting("LLMRUN_GPU_OVERHEAD", "0",
            "GPU memory to leave free on each GPU (for other programs), as 512MiB or 2GiB; "
            "the fit places fewer layers there"),
    Setting("LLMRUN_STEP_BUDGET", "225ms",
            "While others are generating, how long one engine step may take reading a new "
            "prompt (a duration such as 250ms, or a number of prompt tokens per step), so "
            "a long prompt never freezes the streams beside it; 0 = no limit"),
    Setting("LLMRUN_DEBUG", "0",
            "1: debug logs: the daemon's at DEBUG level, and a line per engine step in each "
            "runner's log (its rows, the prompt pieces it read and where, its time, the "
            "time spent keeping prompt states), for finding where latency goes"),
    Setting("LLMRUN_CACHE", "",
            "Downloads that can be thrown away (models' wheels fetched from PyPI); empty: "
            "the platform's cache directory (~/.cache/llmrun)"),
    Setting("LLMRUN_NOHISTORY", "0",
            "1: `llmrun run`'s chat keeps no history file of what is typed"),
    Setting("LLMRUN_WATCHDOG", "300s",
            "A runner with requests in flight that reports nothing for this long is "
            "restarted and its requests fail"),
]
_DEFAULTS = {s.name: s.default for s in SETTINGS}


def home() -> Path:
    raw = os.environ.get("LLMRUN_HOME") or platformdirs.user_data_dir("llmrun", appauthor=False)
    return Path(raw).expanduser()


def make_private(directory: Path) -> Path:
    """Create `directory` readable by its owner only (0700), and tighten it if an older
    version left it open: it holds prompts in logs, keys in config.yaml and the models."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if directory.stat().st_mode & 0o077:
            directory.chmod(0o700)
    except OSError as exc:  # not ours (a shared mount): say so, do not stop
        log.warning("cannot make %s private: %s", directory, exc.strerror or exc)
    return directory


def cache_dir() -> Path:
    """Downloads that can be thrown away (wheels fetched from PyPI, for instance)."""
    value = raw("LLMRUN_CACHE") or platformdirs.user_cache_dir("llmrun", appauthor=False)
    return Path(value).expanduser()


@cache
def _file_settings(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    import yaml  # here: most runs have no config.yaml, and every CLI command reads settings

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}
    if not isinstance(data, dict):
        log.warning("ignoring %s: expected a mapping of LLMRUN_* names", path)
        return {}
    return {str(k).upper(): v for k, v in data.items()}


def default(name: str) -> str:
    """The built-in value of one setting (what it is when nothing sets it)."""
    return _DEFAULTS[name]


def raw(name: str) -> str:
    """The string value of one setting: environment first (an empty variable counts as
    unset), then config.yaml, then the default."""
    if os.environ.get(name):
        return os.environ[name]
    file_value = _file_settings(home() / "config.yaml").get(name)
    if file_value is not None:
        return str(file_value)
    return _DEFAULTS[name]


def _parsed(name: str, parse: Callable[[str], T]) -> T:
    value = raw(name)
    try:
        return parse(value)
    except ValueError:
        log.warning("invalid %s=%r, using default %r", name, value, _DEFAULTS[name])
        return parse(_DEFAULTS[name])


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(value)
    return n


def host() -> tuple[str, int]:
    """(host, port) from LLMRUN_HOST; accepts `host`, `host:port`, `:port`, `[v6]:port`, URLs."""
    return _parsed("LLMRUN_HOST", parse_host)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    if host in ("localhost",) or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_host(value: str) -> tuple[str, int]:
    value = value.strip()
    for scheme in ("http://", "https://"):
        if value.startswith(scheme):
            value = value[len(scheme) :]
    value = value.rstrip("/")
    if not value:
        raise ValueError("empty host")
    if value.startswith("["):
        addr, _, rest = value[1:].partition("]")
        port = rest.lstrip(":") or str(DEFAULT_PORT)
    elif value.count(":") == 1:
        addr, port = value.split(":")
        port = port or str(DEFAULT_PORT)
    else:
        addr, port = value, str(DEFAULT_PORT)
    port_n = int(port)
    if not 0 < port_n < 65536:
        raise ValueError(f"port out of range: {port}")
    return addr or "127.0.0.1", port_n


def base_url() -> str:
    addr, port = host()
    if addr in ("0.0.0.0", "::", ""):
        addr = "127.0.0.1"
    if ":" in addr:
        addr = f"[{addr}]"
    return f"http://{addr}:{port}"


def num_parallel() -> int:
    return max(1, _parsed("LLMRUN_NUM_PARALLEL", _positive_int))


def context_length() -> int:
    """LLMRUN_CONTEXT_LENGTH, or 0: chosen by memory (server/context.py)."""
    n = _parsed("LLMRUN_CONTEXT_LENGTH", _positive_int)
    return max(16, n) if n else 0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), which a runner's threads can use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def num_threads_fixed() -> int:
    """LLMRUN_NUM_THREADS, or 0 when unset (every core, fewer while others keep cores busy)."""
    return _parsed("LLMRUN_NUM_THREADS", _positive_int)


def max_queue() -> int:
    return _parsed("LLMRUN_MAX_QUEUE", _positive_int)


def rpc_workers() -> tuple[str, ...]:
    return _parsed("LLMRUN_RPC_WORKERS", parse_rpc_workers)


def parse_rpc_workers(value: str) -> tuple[str, ...]:
    """host:port,host:port (a v6 host in brackets); each checked, in order, no repeats."""
    out: list[str] = []
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(item)
        if item not in out:
            out.append(item)
    return tuple(out)


def rpc_split() -> str:
    return _parsed("LLMRUN_RPC_SPLIT", parse_rpc_split)


def parse_rpc_split(value: str) -> str:
    if value.strip():
        shares = [float(x) for x in value.split(",")]
        if any(not 0 <= x < float("inf") for x in shares) or not sum(shares) > 0:
            raise ValueError(value)
    return value.strip()


def gpus() -> tuple[str, ...] | None:
    """LLMRUN_GPUS: the GPUs models may use, by name or index (None: all; (): none)."""
    return _parsed("LLMRUN_GPUS", parse_gpus)


def parse_gpus(value: str) -> tuple[str, ...] | None:
    text = value.strip()
    if not text:
        return None
    if text.lower() in ("none", "-1"):  # -1 as CUDA_VISIBLE_DEVICES hides every device
        return ()
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise ValueError(value)
    return items


def gpu_overhead() -> int:
    """LLMRUN_GPU_OVERHEAD: bytes the fit leaves free on each GPU."""
    return _parsed("LLMRUN_GPU_OVERHEAD", parse_size)


def upstream_parallel() -> int:
    return max(1, _parsed("LLMRUN_UPSTREAM_PARALLEL", _positive_int))


def remote_create() -> bool:
    """Whether /api/create over HTTP may create remote models (off by default)."""
    return _parsed("LLMRUN_REMOTE_CREATE", _flag)


def remote_link_local() -> bool:
    """Whether remote models may connect to link-local and cloud metadata addresses."""
    return _parsed("LLMRUN_REMOTE_LINK_LOCAL", _flag)


_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def parse_remote_keys(value: str) -> dict[str, str]:
    """`name=ENV_VAR,...` as {name: ENV_VAR}; a malformed entry is a ValueError."""
    keys: dict[str, str] = {}
    for entry in value.split(","):
        if not entry.strip():
            continue
        name, sep, var = (part.strip() for part in entry.partition("="))
        if not sep or not _KEY_NAME.fullmatch(name) or not _ENV_NAME.fullmatch(var):
            raise ValueError(entry)
        keys[name] = var
    return keys


def remote_keys() -> dict[str, str]:
    """The keys the daemon's owner lets remote models send: {name: environment variable}.
    A Modelfile names one of these names, never a variable: the owner alone decides which
    of the daemon's secrets may leave it. config.yaml may also give a mapping."""
    file_value = _file_settings(home() / "config.yaml").get("LLMRUN_REMOTE_KEYS")
    if not os.environ.get("LLMRUN_REMOTE_KEYS") and isinstance(file_value, dict):
        value = ",".join(f"{k}={v}" for k, v in file_value.items())
    else:
        value = raw("LLMRUN_REMOTE_KEYS")
    try:
        return parse_remote_keys(value)
    except ValueError as exc:  # no key is better than a guess at which one was meant
        log.warning("invalid LLMRUN_REMOTE_KEYS entry %r: remote models send no key", str(exc))
        return {}


def upstream_timeout() -> float:
    return _parsed("LLMRUN_UPSTREAM_TIMEOUT", _positive_float)


def _positive_float(value: str) -> float:
    n = float(value)
    if not n > 0 or n == float("inf"):
        raise ValueError(value)
    return n


def max_loaded_models() -> int:
    return max(1, _parsed("LLMRUN_MAX_LOADED_MODELS", _positive_int))


def keep_alive() -> str:
    return raw("LLMRUN_KEEP_ALIVE")


def _flag(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


def _sandbox_mode(value: str) -> str:
    if value.strip().lower() == "strict":
        return "strict"
    return "on" if _flag(value) else "off"


def sandbox_mode() -> str:
    """"on" (confine what the kernel allows), "strict" (refuse to run unconfined), "off"."""
    return _parsed("LLMRUN_SANDBOX", _sandbox_mode)


def sandbox() -> bool:
    return sandbox_mode() != "off"


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4,
          "tb": 1000**4, "tib": 1 << 40}


def parse_size(value: str) -> int:
    """Bytes from `1048576`, `64MiB`, `2GB`, `512k` (case-insensitive)."""
    text = value.strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):]
    if not num or unit not in _UNITS:
        raise ValueError(value)
    n = int(float(num) * _UNITS[unit])
    if n < 0:
        raise ValueError(value)
    return n


def parse_seconds(value: str) -> float:
    """Seconds from `30`, `30s`, `5m`, `1h`."""
    text = value.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(text[-1:])
    n = float(text[:-1] if scale else text) * (scale or 1)
    if n < 0:
        raise ValueError(value)
    return n


def max_body_size() -> int:
    return _parsed("LLMRUN_MAX_BODY_SIZE", parse_size)


def max_blob_size() -> int:
    return _parsed("LLMRUN_MAX_BLOB_SIZE", parse_size)


def max_messages() -> int:
    return max(1, _parsed("LLMRUN_MAX_MESSAGES", _positive_int))


def max_stop() -> int:
    return _parsed("LLMRUN_MAX_STOP", _positive_int)


def max_images() -> int:
    return _parsed("LLMRUN_MAX_IMAGES", _positive_int)


def max_image_size() -> int:
    return _parsed("LLMRUN_MAX_IMAGE_SIZE", parse_size)


def max_audio() -> int:
    return _parsed("LLMRUN_MAX_AUDIO", _positive_int)


def max_audio_size() -> int:
    return _parsed("LLMRUN_MAX_AUDIO_SIZE", parse_size)


def debug() -> bool:
    return _parsed("LLMRUN_DEBUG", _flag)


def no_history() -> bool:
    """Whether the chat keeps what is typed out of its history file."""
    return _parsed("LLMRUN_NOHISTORY", _flag)


def image_urls() -> bool:
    """Whether the daemon downloads images named by http(s) URL (off by default)."""
    return _parsed("LLMRUN_IMAGE_URLS", _flag)


def rate_limit() -> int:
    """Requests per minute per key or client; 0 = no limit."""
    return _parsed("LLMRUN_RATE_LIMIT", _positive_int)


def realtime_sessions() -> int:
    return _parsed("LLMRUN_REALTIME_SESSIONS", _positive_int)


def realtime_sessions_per_client() -> int:
    return _parsed("LLMRUN_REALTIME_SESSIONS_PER_CLIENT", _positive_int)


def realtime_rate() -> int:
    """Events a second per realtime session; 0 = no limit."""
    return _parsed("LLMRUN_REALTIME_RATE", _positive_int)


def realtime_max_audio() -> float:
    """Seconds of sound one realtime session may be sent over its life."""
    return _parsed("LLMRUN_REALTIME_MAX_AUDIO", parse_seconds)


def parse_step_budget(value: str) -> tuple[float, int]:
    """(seconds, tokens) of a step budget: `150ms` or `0.2s` is a time, `64` a number of
    prompt tokens per step; (0, 0) is no limit."""
    text = value.strip().lower()
    if text.endswith("ms"):
        return parse_seconds(text[:-2]) / 1000, 0
    if text.endswith(("s", "m", "h")):
        return parse_seconds(text), 0
    return 0.0, _positive_int(text)


def step_budget() -> str:
    """LLMRUN_STEP_BUDGET as the runner's Load.step_budget (it parses it with
    parse_step_budget); one that does not parse is the default, with a warning."""
    value = raw("LLMRUN_STEP_BUDGET")
    try:
        parse_step_budget(value)
    except ValueError:
        log.warning("invalid LLMRUN_STEP_BUDGET=%r, using default %r", value,
                    default("LLMRUN_STEP_BUDGET"))
        return default("LLMRUN_STEP_BUDGET")
    return value


def watchdog_seconds() -> float:
    return max(1.0, _parsed("LLMRUN_WATCHDOG", parse_seconds))


def api_keys() -> list[str]:
    return [k.strip() for k in raw("LLMRUN_API_KEYS").split(",") if k.strip()]


def prompt_cache_size() -> int:
    """Bytes of prompt states on disk, all models together; 0: no prompt cache."""
    return _parsed("LLMRUN_PROMPT_CACHE_SIZE", parse_size)


def prompt_cache_ram() -> int:
    return _parsed("LLMRUN_PROMPT_CACHE_RAM", parse_size)


def prompt_cache_min_tokens() -> int:
    return max(1, _parsed("LLMRUN_PROMPT_CACHE_MIN_TOKENS", _positive_int))


def choice_word(value: str) -> str:
    """A choice as a setting or an option may write it: any case, and a switch also as
    true/false or 1/0 (read as on/off)."""
    text = value.strip().lower()
    return {"true": "on", "1": "on", "false": "off", "0": "off"}.get(text, text)


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        text = choice_word(value)
        if text not in allowed:
            raise ValueError(value)
        return text
    return parse


def kv_cache_type() -> str:
    return _parsed("LLMRUN_KV_CACHE_TYPE", _choice("f16", "q8_0", "q4_0"))


def flash_attention() -> str:
    return _parsed("LLMRUN_FLASH_ATTENTION", _choice("auto", "on", "off"))
