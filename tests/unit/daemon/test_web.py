"""The web page's files as the daemon serves them (llmrun/daemon/web.py), without a browser:
every file the page loads is in the served table, and nothing else is."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from fastapi import FastAPI
from fastapi.testclient import TestClient

from llmrun.daemon import security, web

TABLE = web.assets()
# what index.html loads, and what each module imports (relative specifiers only: the page
# has no import map, so a bare name would fail in the browser)
LOADS = re.compile(r'(?:src|href)="([^"#:]+)"')
IMPORTS = re.compile(r'^\s*import\b[^"\']*["\']([^"\']+)["\']', re.M)


def resolve(base: str, ref: str) -> str:
    parts: list[str] = []
    for part in (PurePosixPath(base).parent / ref).parts:
        if part == "..":
            parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


def test_every_file_the_page_loads_is_served() -> None:
    wanted = {resolve("index.html", ref)
              for ref in LOADS.findall(TABLE["index.html"].body.decode())}
    seen: set[str] = set()
    while wanted - seen:
        path = (wanted - seen).pop()
        seen.add(path)
        assert path in TABLE, f"the page loads {path}, which is not served"
        if path.endswith((".js", ".mjs")):
            for ref in IMPORTS.findall(TABLE[path].body.decode()):
                assert ref.startswith((".", "/")), f"{path} imports a bare name: {ref}"
                wanted.add(resolve(path, ref))
    assert {"main.js", "render.js", "vendor/dompurify/purify.es.mjs",
            "vendor/marked/marked.esm.js", "vendor/highlight/core.min.js"} <= seen


def test_notes_and_licences_are_not_served_and_types_are_exact() -> None:
    assert not [p for p in TABLE if p.endswith((".md", "LICENSE"))]
    assert TABLE[""] == TABLE["index.html"]
    assert TABLE["vendor/dompurify/purify.es.mjs"].media_type.startswith("text/javascript")
    assert TABLE["style.css"].media_type.startswith("text/css")


def test_the_page_has_no_inline_script_or_style() -> None:
    html = TABLE["index.html"].body.decode()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script type="module" src="main.js">']
    assert "<style" not in html
    assert not re.search(r"<[^>]*\s(on\w+|style)=", html)  # no handler, no style attribute


def test_the_key_check_opens_exactly_the_page() -> None:
    assert security.OPEN_PREFIX == web.PREFIX
    assert web.PREFIX.rstrip("/") in security.OPEN_PATHS


def test_served_with_the_policy_and_nothing_outside_the_table() -> None:
    app = FastAPI()
    app.include_router(web.router())
    client = TestClient(app)
    r = client.get("/ui/")
    assert r.status_code == 200 and r.headers["content-security-policy"] == web.CSP
    assert client.get("/ui", follow_redirects=False).headers["location"] == "/ui/"
    head = client.head("/ui/main.js")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["etag"] == client.get("/ui/main.js").headers["etag"]
    for path in ("/ui/nope.js", "/ui/vendor/VENDOR.md", "/ui/vendor/marked/LICENSE"):
        missing = client.get(path)
        assert missing.status_code == 404
        assert missing.headers["content-security-policy"] == web.CSP


def test_every_vendored_file_is_pinned_with_its_licence() -> None:
    """VENDOR.md's table (what scripts/web-vendor.sh fetches) and the vendor folder agree."""
    vendor = web.ROOT / "vendor"
    listed = set()
    for row in re.findall(r"^\| `[^`]+` \|.*$", (vendor / "VENDOR.md").read_text(), re.M):
        cells = [c.strip().strip("`") for c in row.strip("|").split("|")]
        _, version, integrity, into, files = cells
        assert re.fullmatch(r"\d+\.\d+\.\d+", version) and integrity.startswith("sha512-")
        assert "LICENSE" in files.split()
        for f in files.split():  # a package path, or path=name in the vendor folder
            listed.add(f"{into}/" + (f.split("=", 1)[1] if "=" in f else f.rsplit("/", 1)[-1]))
    present = {p.relative_to(vendor).as_posix() for p in vendor.rglob("*") if p.is_file()}
    assert present - {"VENDOR.md"} == listed
