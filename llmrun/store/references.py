"""What a Modelfile's FROM and ADAPTER lines may name, told apart on their text: an uploaded
blob (`sha256:...`), a file on this machine, a model name, or a remote server's URL (a
remote model, whose manifest is built here); and what a caller over HTTP may name."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from llmrun import config
from llmrun.store import modelfile, names, remoteaddr
from llmrun.store.errors import CreateError, InvalidName
from llmrun.store.manifests import Details, Manifest, Remote

# Over HTTP every refused reference gets this one answer, whether or not such a file exists:
# a remote caller must learn nothing about the server's disk (CVE-2024-39719 in Ollama).
HOST_PATH_REFUSED = ("create over HTTP takes a model name or an uploaded blob (sha256:...), "
                     "not a path on the server: upload files to /api/blobs first "
                     "(`llmrun create` reads local files for you)")
REMOTE_REFUSED = ("FROM http(s)://: a remote model makes this server connect where the "
                  "Modelfile says, with a key its owner configured, so over HTTP it is "
                  "created only where the owner set LLMRUN_REMOTE_CREATE=1; `llmrun create` "
                  "on the server's machine writes the store directly and may")


def local_file(ref: str, base_dir: Path) -> Path | None:
    """The GGUF file on this machine a FROM names (relative to `base_dir`); None when `ref`
    is no file and does not look like one (a model name)."""
    path = Path(ref).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    looks_like_path = ref.startswith((".", "/", "~")) or ref.lower().endswith(".gguf")
    if path.is_file() or looks_like_path:
        if not path.is_file():
            raise CreateError(f"FROM {ref}: no such file")
        return path
    return None


def is_blob_ref(ref: str) -> bool:
    return ref.startswith(("sha256:", "sha256-", "@sha256:"))


def _names_a_model(ref: str) -> bool:
    """A valid model name that no file system or URL reading could take for a location."""
    text = ref.strip()
    if "://" in text or "\\" in text or text.startswith((".", "/", "~")) \
            or text.lower().endswith(".gguf"):
        return False
    try:
        names.parse(text)
    except InvalidName:
        return False
    return True


def refuse_host_paths(mf: modelfile.Modelfile, allow_remote: bool = False) -> None:
    """For remote callers: FROM an uploaded blob or a model name (or, with `allow_remote`, a
    remote server's URL), ADAPTERs uploaded blobs only. Anything else (a path, `~`) gets
    HOST_PATH_REFUSED, decided on the text alone, never on the disk."""
    for ref in mf.froms:  # each FROM: a remote one does not vouch for a second (projector)
        if is_remote(ref):
            if not allow_remote:
                raise CreateError(REMOTE_REFUSED)
        elif not (is_blob_ref(ref) or _names_a_model(ref)):
            raise CreateError(HOST_PATH_REFUSED)
    if not all(is_blob_ref(ref) for ref in mf.adapters):
        raise CreateError(HOST_PATH_REFUSED)


def is_remote(ref: str) -> bool:
    return ref.lower().startswith(("http://", "https://"))


def _remote_url(url: str, what: str) -> str:
    """A replica's base URL, checked: http(s), a host, no credentials (keys are named by
    remote_key and never stored), no query or fragment, not a link-local or metadata
    address (unless the owner allows them); without a trailing slash."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a malformed port
    except ValueError:
        raise CreateError(f"{what}: {url!r} is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CreateError(f"{what}: {url!r} must be an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise CreateError(f"{what}: put no credentials in the URL (they would be stored); name "
                          "a key the daemon's owner configured with remote_key")
    if parts.query or parts.fragment:
        raise CreateError(f"{what}: {url!r}: a base URL has no query or fragment")
    reason = None if config.remote_link_local() else remoteaddr.host_refusal(parts.hostname)
    if reason is not None:
        raise CreateError(f"{what}: {url!r}: {reason}, where a remote model may not connect "
                          f"({remoteaddr.LINK_LOCAL_HINT})")
    del port
    return url.rstrip("/")


def remote_manifest(mf: modelfile.Modelfile, target: names.ModelName) -> Manifest:
    """The manifest of a model served by another server (FROM http(s)://...)."""
    if not is_remote(mf.from_):
        raise CreateError("remote_model, remote_replica and remote_key need FROM with the "
                          "http(s):// base URL of the server's OpenAI-compatible API")
    if mf.template is not None:
        raise CreateError("TEMPLATE: a remote model's server applies its own chat template")
    urls = [_remote_url(mf.from_, "FROM")]
    urls += [_remote_url(u, "PARAMETER remote_replica")
             for u in mf.remote.get("remote_replica", [])]
    key = _key_name(mf)
    model = mf.remote.get("remote_model") or \
        (target.model if target.tag == "latest" else f"{target.model}:{target.tag}")
    return Manifest(name="", remote=Remote(urls=list(dict.fromkeys(urls)), model=model,
                                           key=key),
                    parameters=mf.parameters, template=None, system=mf.system,
                    messages=mf.messages, license=mf.license,
                    details=Details(format="remote", family="remote"), source=urls[0])


KEYS_HELP = ("the daemon's owner names the keys remote models may send in LLMRUN_REMOTE_KEYS "
             "(name=ENV_VAR, comma-separated; or a mapping in config.yaml)")


def _key_name(mf: modelfile.Modelfile) -> str | None:
    """The configured key a remote Modelfile names: `remote_key NAME`, or the older
    `remote_key_env VAR` where a configured key reads VAR. A Modelfile is written by whoever
    may create models; the daemon's environment is its owner's, so a Modelfile never picks
    a variable of its own (HF_TOKEN, LLMRUN_API_KEYS... would otherwise go to its URL)."""
    keys = config.remote_keys()
    name: str | None = mf.remote.get("remote_key")
    var: str | None = mf.remote.get("remote_key_env")
    if name is not None and var is not None:
        raise CreateError("give PARAMETER remote_key or remote_key_env, not both")
    if var is not None:
        named = [n for n, v in keys.items() if v == var]
        if not named:
            raise CreateError(f"PARAMETER remote_key_env {var!r}: a Modelfile may not name an "
                              "environment variable to send: name a key with PARAMETER "
                              f"remote_key; {KEYS_HELP}")
        return named[0]
    if name is not None and name not in keys:
        raise CreateError(f"PARAMETER remote_key {name!r}: no such key is configured here; "
                          f"{KEYS_HELP}")
    return name


class RemoteKeyError(ValueError):
    """A remote model's manifest names a key this daemon's owner does not configure."""


def key_variable(remote: Remote) -> str | None:
    """The environment variable whose value `remote` sends as its key, read when it is sent
    (None: no key). A manifest may be older than the configuration, or written by an older
    version naming a raw variable (`key_env`): a variable is sent only while a configured
    key reads it."""
    keys = config.remote_keys()
    if remote.key is not None:
        if remote.key not in keys:
            raise RemoteKeyError(f"its key {remote.key!r} is not configured on this server; "
                                 f"{KEYS_HELP}")
        return keys[remote.key]
    if remote.key_env is not None:
        if remote.key_env not in keys.values():
            raise RemoteKeyError("its manifest names an environment variable for its key, "
                                 "which no configured key reads; create it again with "
                                 f"PARAMETER remote_key; {KEYS_HELP}")
        return remote.key_env
    return None
