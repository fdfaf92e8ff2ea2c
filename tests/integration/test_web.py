"""The web page (/ui/) in a real browser: headless Chromium (Debian's, installed by
scripts/browser-env.sh) driven by Playwright, against real daemons serving SmolLM2.

One daemon holds SmolLM2, a vision model (SmolLM2 and tests/fakes/vision.py's projector) and
`fake`, a remote model whose "remote server" is a stub in this file that streams exactly
what a test tells it: hostile output, deterministically. A second daemon has API keys and
a tiny model, and pulls from the fake Hub. Every page a test opens is watched until the test
ends: a console error, an uncaught exception, a dialog or a request to another origin fails it.

The serving tests (headers, redirects, paths) need no browser and run without one; the
others fail without one, since CI must run them (tests/ci_groups.py), unless
LLMRUN_TEST_SKIP=browser.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from llmrun.store import Store
from tests.ci_groups import needs
from tests.conftest import Daemon, make_home, wait_until
from tests.fakes.hubserver import HubServer
from tests.fakes.tinymodel import write_tiny_llama
from tests.fakes.vision import image, write_projector
from tests.integration.test_service import tiny_home

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "web"
WHY = ROOT / ".browser.why"  # scripts/browser-env.sh: why there is no browser here
KEY = "web-test-key-4f1e"
CHROMIUM = os.environ.get("LLMRUN_TEST_CHROMIUM") or shutil.which("chromium") \
    or shutil.which("chromium-browser")


def _unavailable() -> str:
    """Why there is no browser here ("": there is one). A test that needs one then fails,
    unless LLMRUN_TEST_SKIP=browser (tests/ci_groups.py)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if WHY.exists():  # written by the last scripts/browser-env.sh that failed, removed by one
        return f"{WHY.read_text().strip()} (recorded in {WHY.name} by scripts/browser-env.sh)"
    if not CHROMIUM:
        return "no Chromium (make test installs it: scripts/browser-env.sh)"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"LLMRUN_TEST_CHROMIUM={CHROMIUM} is not an executable file"
    return ""


needs_browser = needs("browser", _unavailable)

# -- hostile output ----------------------------------------------------------------------------

# Each line is something a model could be made to write that would run script, load
# something or navigate if the page rendered it as HTML; the words in capitals must still
# be shown. Anything that runs sets window.pwned or opens a dialog.
PAYLOAD = "\n\n".join([
    'ONE <img src=x onerror="window.pwned=1;alert(1)"> img',
    "TWO <script>window.pwned=2;alert(2)</script> script",
    'THREE <a href="javascript:window.pwned=3">click me</a> link',
    'FOUR <iframe src="javascript:parent.pwned=4" srcdoc="<script>parent.pwned=4</script>">'
    "</iframe> frame",
    'FIVE <svg onload="window.pwned=5"><script>window.pwned=5</script></svg> svg',
    "SIX [markdown link](javascript:window.pwned=6) and [data](data:text/html,<script>"
    "parent.pwned=6</script>) and [vb](vbscript:msgbox(6))",
    "SEVEN ![markdown image](http://127.0.0.1:1/leak.png) and ![x](javascript:alert(7))",
    'EIGHT <a href="https://example.com/ok" onclick="window.pwned=8">a fine link</a>',
    'NINE <form action="/api/delete"><button formaction="javascript:alert(9)">go</button>'
    "</form> <math><mi xlink:href=\"javascript:alert(9)\">m</mi></math>",
    'TEN <div style="position:fixed;inset:0;background:red" class="msg user">cover</div>',
    "ELEVEN <details open ontoggle=\"window.pwned=11\">x</details> "
    "<video><source onerror=\"window.pwned=11\"></video>",
])
MARKERS = ["ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT", "NINE", "TEN",
           "ELEVEN", "click me", "markdown link", "a fine link", "cover"]
THOUGHT = "<img src=x onerror=\"window.pwned='thinking'\"> THOUGHT"


class FakeUpstream(ThreadingHTTPServer):
    """An OpenAI-compatible server that streams `answer` (and `thought` as reasoning) in
    small pieces, cutting tags in two. A user message "echo: ..." is answered with itself.
    Each piece counts as a token for `max_tokens`. `asked` is the last request's body."""

    answer = PAYLOAD
    thought = THOUGHT
    asked: Any = None


class _Handler(BaseHTTPRequestHandler):
    server: FakeUpstream

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:  # the health probe
        self._send(200, b'{"object": "list", "data": []}', "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.asked = body
        last = body["messages"][-1]["content"]
        echo = isinstance(last, str) and last.startswith("echo: ")
        answer, thought = (last, "") if echo else (self.server.answer, self.server.thought)
        frames = [{"choices": [{"index": 0, "delta": {"reasoning_content": thought[i:i + 5]}}]}
                  for i in range(0, len(thought), 5)]
        pieces = [answer[i:i + 7] for i in range(0, len(answer), 7)]
        limit = body.get("max_tokens") or len(pieces)
        frames += [{"choices": [{"index": 0, "delta": {"content": piece}}]}
                   for piece in pieces[:limit]]
        finish = "length" if limit < len(pieces) else "stop"
        frames.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                       "usage": {"prompt_tokens": 11, "completion_tokens": len(frames)}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for frame in frames:
            self.wfile.write(b"data: " + json.dumps(frame).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# -- daemons -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    server = FakeUpstream(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path,
        upstream: FakeUpstream) -> Iterator[Daemon]:
    home = make_home(tmp_path_factory.mktemp("web-home"), smollm2_path)
    store = Store(home)
    store.create("vis", f"FROM {smollm2_path}\nFROM {write_projector(home / 'mmproj.gguf')}\n")
    store.create("fake", f"FROM http://127.0.0.1:{upstream.server_address[1]}/v1\n"
                 "PARAMETER remote_model payload\n")
    d = Daemon(home).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    server = HubServer()
    model = write_tiny_llama(tmp_path_factory.mktemp("hub") / "tiny.gguf", seed=3)
    server.add_file("org/tiny-GGUF", "tiny-Q4_K_M.gguf", model)
    with server:
        yield server


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, hub: HubServer) -> Iterator[Daemon]:
    home = tiny_home(tmp_path_factory.mktemp("web-keyed"), ["tiny"])
    d = Daemon(home, env={"LLMRUN_API_KEYS": KEY, "HF_ENDPOINT": hub.url.rstrip("/"),
                          "HF_HUB_OFFLINE": "0", "HF_TOKEN": ""}).start()
    yield d
    d.stop()


# -- serving, without a browser ----------------------------------------------------------------

def raw_get(url: str, path: str) -> tuple[int, bytes]:
    """GET `path` as written: http.client sends it byte for byte (httpx would normalise
    `..` away before the daemon saw it)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_browser_goes_to_the_page_api_clients_see_the_line(keyed: Daemon) -> None:
    url = keyed.url
    r = httpx.get(url + "/", headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert r.status_code == 302 and r.headers["location"] == "/ui/"
    assert httpx.get(url + "/").text == "llmrun is running"
    assert httpx.head(url + "/", headers={"Accept": "text/html"}).status_code == 200
    # the page's files need no key (the page asks for it); the API still does
    page = httpx.get(url + "/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="main.js">' in page.text
    csp = page.headers["content-security-policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "frame-ancestors 'none'",
                      "connect-src 'self'", "require-trusted-types-for 'script'"):
        assert directive in csp
    assert "unsafe" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    js = httpx.get(url + "/ui/vendor/dompurify/purify.es.mjs")
    assert js.headers["content-type"].startswith("text/javascript")
    again = httpx.get(url + "/ui/main.js", headers={"If-None-Match": js.headers["etag"]})
    assert again.status_code == 200
    cached = httpx.get(url + "/ui/main.js")
    assert httpx.get(url + "/ui/main.js", headers={
        "If-None-Match": cached.headers["etag"]}).status_code == 304
    assert httpx.get(url + "/api/tags").status_code == 401
    # the page's own origin (a loopback one) passes the Origin check, another does not
    assert httpx.get(url + "/ui/", headers={"Origin": "https://evil.example"}).status_code \
        == 403
    assert httpx.get(url + "/ui/", headers={"Host": "evil.example"}).status_code == 403


@pytest.mark.parametrize("path", [
    "/ui/../api/tags", "/ui/%2e%2e/api/tags", "/ui/..%2fapi%2ftags", "/ui//etc/passwd",
    "/ui/../../pyproject.toml", "/ui/%2e%2e/%2e%2e/daemon/web.py", "/ui/vendor/VENDOR.md",
    "/ui/vendor/marked/LICENSE", "/ui/.", "/ui/vendor", "/ui/main.js/", "/ui/%00",
])
def test_only_the_page_files_are_served(keyed: Daemon, path: str) -> None:
    """No path leaves the table of files; and the key check, open below /ui/, opens no API
    route that way (this daemon has keys, and none is sent)."""
    status, body = raw_get(keyed.url, path)
    assert status in (400, 404), (path, status)
    assert b"models" not in body and b"[project]" not in body and b"import" not in body


# -- the browser -------------------------------------------------------------------------------

@dataclass
class Watched:
    """A page and what it did: console errors, uncaught errors, dialogs, requests."""

    page: Any
    origin: str
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    allowed_errors: tuple[str, ...] = ()

    def attach(self) -> Watched:
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("dialog", self._dialog)
        self.page.on("request", lambda r: self.requests.append(f"{r.method} {r.url}"))
        return self

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def open(self) -> Watched:
        self.page.goto(self.origin + "/")
        self.page.wait_for_selector("body[data-ready=true]", timeout=60_000)
        return self

    def check(self) -> None:
        errors = [e for e in self.errors if not any(a in e for a in self.allowed_errors)]
        assert not errors, errors
        assert not self.dialogs, self.dialogs
        # the page's own files and API, and the user's attached images (blob: of the page)
        own = (self.origin + "/", f"blob:{self.origin}/")
        outside = [r for r in self.requests if not r.split(" ", 1)[1].startswith(own)]
        assert not outside, outside

    def api_requests(self, since: int = 0) -> list[str]:
        return [r.replace(self.origin, "") for r in self.requests[since:]]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # (only tests marked needs_browser use it: their mark has checked the browser is here)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: as root (CI) Chromium refuses its own sandbox; the page is ours
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def context(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    ctx.set_default_timeout(120_000)
    yield ctx
    ctx.close()


@pytest.fixture
def page(context: Any, web: Daemon) -> Iterator[Watched]:
    watched = Watched(context.new_page(), web.url).attach()
    yield watched.open()
    watched.check()


def pick(page: Watched, model: str) -> None:
    page.page.select_option("#model", f"{model}:latest")


def ask(page: Watched, text: str) -> Any:
    """Send `text`; the answer's element, once the answer ended (done, stopped or failed)."""
    p = page.page
    count = p.locator(".msg.assistant").count()
    p.fill("#prompt", text)
    p.click("#send")
    return finished(page, count)


def finished(page: Watched, index: int) -> Any:
    p = page.page
    p.wait_for_selector("#send:not([hidden])")
    p.wait_for_function(f"() => document.querySelectorAll('.msg.assistant').length > {index}")
    return p.locator(".msg.assistant").nth(index)


def settings(page: Watched, **values: Any) -> None:
    p = page.page
    p.click("#settings-open")
    for name, value in values.items():
        p.fill(f"#{name}", str(value))
    p.click("#settings-form button[type=submit]")
    p.wait_for_selector("#settings-dialog", state="hidden")


GROWTH = """() => {
  // samples the answer's text once per animation frame, from Send until the answer ends
  window.samples = [];
  let began = false;
  const sample = () => {
    const busy = document.getElementById('send').hidden;
    began ||= busy;
    const body = [...document.querySelectorAll('.msg.assistant .body')].at(-1);
    window.samples.push(body ? body.textContent.length : -1);
    if (!began || busy) requestAnimationFrame(sample);
  };
  requestAnimationFrame(sample);
}"""


@needs_browser
def test_page_loads_with_the_models_and_nothing_else(page: Watched) -> None:
    p = page.page
    assert p.url == page.origin + "/ui/"
    options = p.locator("#model option").all_text_contents()
    assert {"smollm2:latest", "vis:latest", "fake:latest"} <= {o.split(" ")[0] for o in options}
    # the CSP's Trusted Types apply: a string assigned as HTML is refused (and logged)
    page.allowed_errors = ("requires 'TrustedHTML' assignment",)
    assert p.evaluate("""() => { try { document.createElement('p').innerHTML = '<b>x</b>'; }
                                 catch (e) { return e.name; } }""") == "TypeError"
    paths = {r.split(" ", 1)[1].removeprefix(page.origin) for r in page.requests}
    assert {"/", "/ui/", "/ui/main.js", "/api/tags", "/api/ps"} <= paths
    # a label for every control a keyboard reaches
    unlabelled = p.evaluate("""() => [...document.querySelectorAll(
        'main input:not([hidden]), main select, main textarea, main button, aside input, ' +
        'aside button')]
        .filter(e => !(e.labels?.length || e.getAttribute('aria-label') || e.textContent.trim()))
        .map(e => e.id || e.outerHTML)""")
    assert unlabelled == []
    # the keyboard's first stop skips to the message box; Enter sends, Shift+Enter does not
    p.keyboard.press("Tab")
    assert p.evaluate("document.activeElement.className") == "skip"
    p.keyboard.press("Enter")
    assert p.evaluate("document.activeElement.id") == "prompt"


@needs_browser
def test_an_answer_streams_stops_and_regenerates(page: Watched, web: Daemon) -> None:
    p = page.page
    pick(page, "smollm2")
    settings(page, temperature=1.0, num_predict=40)
    p.fill("#prompt", "Write a short poem about the sea.")
    p.evaluate(GROWTH)
    p.click("#send")
    first = finished(page, 0)
    samples = p.evaluate("window.samples")
    grown = sorted({s for s in samples if s > 0})
    assert len(grown) >= 3, samples  # the text grew over several frames
    assert samples == sorted(samples), samples  # and only grew
    text = first.locator(".body").inner_text()
    assert "● loaded" in p.locator("#model option[value='smollm2:latest']").inner_text()
    stats = first.locator(".stats").inner_text()
    assert "tokens/s" in stats and "context" in stats and "of 2048" in stats, stats
    assert p.get_attribute("#messages", "aria-busy") == "false"

    first.get_by_role("button", name="Regenerate this answer").click()
    again = finished(page, 0)
    assert p.locator(".msg.assistant").count() == 1
    assert again.locator(".body").inner_text() != text  # sampled again at temperature 1

    # Stop: no token limit, a long answer; stopped once it has begun
    settings(page, num_predict="")
    p.fill("#prompt", "Tell me a very long story about a dragon and a knight.")
    p.click("#send")
    p.wait_for_function("""() => {
        const b = [...document.querySelectorAll('.msg.assistant .body')].at(-1);
        return b && b.textContent.length > 20 }""")
    p.click("#stop")
    stopped = finished(page, 1)
    assert stopped.locator(".stopped").inner_text() == "Stopped"
    assert stopped.locator(".body").inner_text()
    assert stopped.locator(".stats").count() == 0
    # the daemon cancelled the request: its slot is free again
    wait_until(lambda: all(m.get("slots_busy", 0) == 0 for m in
                           httpx.get(web.url + "/api/ps").json()["models"]),
               what="the sequence went on after Stop")


@needs_browser
def test_hostile_output_is_shown_as_text_and_runs_nothing(page: Watched) -> None:
    p = page.page
    # DOMPurify parses the output in a document of its own, which has the page's CSP: that
    # parse reports the payload's style attribute as blocked; it never reaches the page
    # (the attributes left are checked below)
    page.allowed_errors = ("Applying inline style violates",)
    pick(page, "fake")
    before = len(page.requests)
    answer = ask(page, "give me the payload")
    body = answer.locator(".body")
    text = body.inner_text()
    for marker in MARKERS:
        assert marker in text, marker
    assert "[markdown image: http://127.0.0.1:1/leak.png]" in text  # the address, as text
    assert p.evaluate("window.pwned") is None
    assert not page.dialogs
    # nothing loaded: the chat request, then the model list refreshed, and nothing else
    assert set(page.api_requests(before)) <= {"POST /api/chat", "GET /api/tags",
                                              "GET /api/ps", "POST /api/show"}
    # what is left of the markup: Markdown's tags, with no handler, style or odd URL
    left = p.evaluate("""(body) => [...body.querySelectorAll('*')].map(e =>
        [e.tagName, [...e.attributes].map(a => [a.name, a.value])])""", body.element_handle())
    assert {tag for tag, _ in left} <= {"P", "A", "CODE", "SPAN", "EM", "STRONG", "BR"}, left
    odd = [(tag, a) for tag, attributes in left for a in attributes
           if a[0] not in ("href", "rel", "target") and a != ["class", "img-text"]]
    assert not odd, left
    links = body.locator("a[href]")
    assert links.count() == 1
    assert links.first.get_attribute("href") == "https://example.com/ok"
    assert links.first.get_attribute("rel") == "noopener noreferrer"
    assert links.first.get_attribute("target") == "_blank"
    # the thinking, collapsed, as plain text
    thinking = answer.locator("details.thinking")
    assert thinking.get_attribute("open") is None
    thinking.locator("summary").click()
    assert THOUGHT in thinking.locator(".thought").inner_text()
    assert thinking.locator("img").count() == 0
    # reloaded from IndexedDB, it renders the same way
    p.reload()
    p.wait_for_selector("body[data-ready=true]")
    assert p.evaluate("window.pwned") is None
    assert "ELEVEN" in p.locator(".msg.assistant .body").inner_text()


# Known ways past sanitisers and Markdown renderers (mutation XSS, entity and whitespace
# tricks in URLs, attribute injection through Markdown, clobbering, tags that fetch)
VECTORS = [
    "<img src=x onerror=window.pwned=1>", "<svg><script>window.pwned=1</script></svg>",
    "<svg/onload=window.pwned=1>", "<svg><a xlink:href='javascript:window.pwned=1'>x</a></svg>",
    "<math><mtext><table><mglyph><style><img src=x onerror=window.pwned=1>",
    '<noscript><p title="</noscript><img src=x onerror=window.pwned=1>">',
    "<template><img src=x onerror=window.pwned=1></template>",
    "<textarea><img src=x onerror=window.pwned=1></textarea>",
    '<a href="jav&#x09;ascript:window.pwned=1">x</a>', '<a href="&#106;avascript:1">x</a>',
    "[x](javascript&colon;window.pwned=1)", "[x](JaVaScRiPt:window.pwned=1)",
    "[x](<javascript:window.pwned=1>)", "[x]( javascript:window.pwned=1 )",
    "[x](//evil.example/relative)", "[x](/api/delete)", "<https://ok.example/auto>",
    '<a href="data:text/html;base64,PHNjcmlwdD4=">x</a>', '<a href="vbscript:msgbox(1)">x</a>',
    '<iframe srcdoc="<script>parent.pwned=1</script>"></iframe>',
    "<object data=javascript:window.pwned=1></object>", "<embed src=javascript:window.pwned=1>",
    "<form><button formaction=javascript:window.pwned=1>x</button></form>",
    "<input autofocus onfocus=window.pwned=1>", "<details open ontoggle=window.pwned=1>x</details>",
    "<body onload=window.pwned=1>", "<style>@import 'http://127.0.0.1:1/x.css'</style>",
    "<link rel=stylesheet href=http://127.0.0.1:1/x.css>", "<base href=http://127.0.0.1:1/>",
    '<meta http-equiv="refresh" content="0;url=javascript:window.pwned=1">',
    '<a href="https://ok.example" onmouseover=window.pwned=1 style="all:unset">ok</a>',
    "<video><source onerror=window.pwned=1></video>", "<audio src=x onerror=window.pwned=1>",
    "<marquee onstart=window.pwned=1>x</marquee>", "<table background=javascript:1><tr><td>x",
    '![x](x" onerror="window.pwned=1)', '[x](https://ok.example" onclick="window.pwned=1)',
    "![x](data:image/svg+xml,<svg onload=window.pwned=1>)", '<p id="notice" name="body">x</p>',
    "```html\n<script>window.pwned=1</script>\n```", "`<img src=x onerror=window.pwned=1>`",
    "<div><a href=https://ok.example target=_top>x</a></div>", "<span class='msg user'>x</span>",
]
RENDER_ALL = """async (vectors) => {
  const { markdown } = await import('/ui/render.js');
  const box = document.createElement('div');
  document.body.append(box);
  for (const v of vectors) box.append(markdown(v));
  // two frames: anything that would load or run has been started by then
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const left = [...box.querySelectorAll('*')].map(e =>
      [e.tagName, [...e.attributes].map(a => [a.name, a.value])]);
  box.remove();
  return left;
}"""


@needs_browser
def test_the_sanitiser_against_known_vectors(page: Watched) -> None:
    p = page.page
    # reported while DOMPurify parses in its document of its own (see the test above)
    page.allowed_errors = ("Applying inline style violates", "Setting the document's base URI")
    before = len(page.requests)
    left = p.evaluate(RENDER_ALL, VECTORS)
    assert p.evaluate("window.pwned") is None
    assert page.api_requests(before) == []  # nothing fetched (render.js is loaded already)
    tags = {tag for tag, _ in left}
    assert tags <= {"P", "A", "CODE", "PRE", "SPAN", "DIV", "BUTTON", "EM", "STRONG", "DEL",
                    "BR", "TABLE", "THEAD", "TBODY", "TR", "TD", "TH"}, tags
    for tag, attributes in left:
        for name, value in attributes:
            if name == "href":
                assert tag == "A" and value.startswith("https://ok.example"), value
            elif name == "class":  # the page's own (code boxes, image text, highlighting)
                assert all(c in ("code", "copy", "img-text", "language-html", "hljs")
                           or c.startswith("hljs-") or c.endswith("_")
                           for c in value.split()), value
            else:
                assert (tag, name) in {("A", "rel"), ("A", "target"), ("BUTTON", "type"),
                                       ("BUTTON", "aria-label")}, (tag, name, value)
                assert value in ("noopener noreferrer", "_blank", "button", "Copy the code")
    # what the code block holds is shown, as code
    assert ["CODE", [["class", "language-html hljs"]]] in left


@needs_browser
def test_edit_and_resend(page: Watched) -> None:
    p = page.page
    pick(page, "fake")
    ask(page, "echo: first")
    p.fill("#prompt", "echo: second")
    p.press("#prompt", "Shift+Enter")  # a new line, not sent
    assert p.input_value("#prompt") == "echo: second\n"
    ask(page, "echo: second")
    assert p.locator(".msg").count() == 4
    user = p.locator(".msg.user").first
    user.get_by_role("button", name="Edit and resend this message").click()
    p.fill(".msg.user textarea.edit", "echo: <b>edited</b>")
    p.get_by_role("button", name="Send the edited message").click()
    answer = finished(page, 0)
    assert p.locator(".msg").count() == 2  # what came after the edited message is gone
    assert p.locator(".msg.user .body").inner_text() == "echo: <b>edited</b>"  # as text
    assert answer.locator(".body b").inner_text() == "edited"  # the echo, as Markdown
    assert answer.get_by_text("Cut at the token limit").count() == 0
    settings(page, num_predict=2)
    cut = ask(page, "echo: one two three four")
    assert cut.locator(".body").inner_text() == "echo: one two"  # two pieces of seven
    assert cut.get_by_text("Cut at the token limit").is_visible()


CODE = "echo: Here:\n\n```python\ndef add(a, b):\n    return a + b\n```\n"


@needs_browser
def test_code_is_highlighted_and_copied(context: Any, page: Watched) -> None:
    p = page.page
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=page.origin)
    pick(page, "fake")
    p.fill("#prompt", CODE)
    p.press("#prompt", "Enter")
    answer = finished(page, 0)
    code = answer.locator(".code pre code.hljs")
    assert code.locator("span.hljs-keyword").first.inner_text() == "def"
    assert code.inner_text() == "def add(a, b):\n    return a + b\n"
    answer.get_by_role("button", name="Copy the code").click()
    answer.get_by_text("Copied").wait_for()
    assert p.evaluate("navigator.clipboard.readText()") == "def add(a, b):\n    return a + b\n"


@needs_browser
def test_conversation_survives_reload_and_export_then_import(
        page: Watched, upstream: FakeUpstream, tmp_path: Path) -> None:
    p = page.page
    pick(page, "fake")
    settings(page, system="You are terse.", temperature=0.5, top_p=0.9, num_predict=50)
    ask(page, "echo: remember **me**")
    asked = upstream.asked  # the conversation's settings went with the request
    assert asked["messages"] == [{"role": "system", "content": "You are terse."},
                                 {"role": "user", "content": "echo: remember **me**"}]
    assert (asked["temperature"], asked["top_p"], asked["max_tokens"]) == (0.5, 0.9, 50)
    p.reload()
    p.wait_for_selector("body[data-ready=true]")
    assert p.locator(".msg.user .body").inner_text() == "echo: remember **me**"
    assert p.locator(".msg.assistant .body strong").inner_text() == "me"
    assert p.locator("#conversations button.conversation").all_inner_texts() == [
        "echo: remember **me**"]
    p.fill("#search", "nothing like it")
    p.wait_for_function("() => document.querySelectorAll('#conversations li').length === 0")
    p.fill("#search", "REMEMBER")
    p.wait_for_function("() => document.querySelectorAll('#conversations li').length === 1")

    with p.expect_download() as download:
        p.click("#export")
    saved = tmp_path / "export.json"
    download.value.save_as(saved)
    exported = json.loads(saved.read_text())
    [conversation] = exported["conversations"]
    assert conversation["settings"] == {"system": "You are terse.", "temperature": 0.5,
                                        "top_p": 0.9, "num_predict": 50}
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]

    p.get_by_role("button", name="Delete echo: remember **me**").click()
    p.wait_for_function("() => document.querySelectorAll('#conversations li').length === 0")
    assert p.locator(".msg").count() == 0
    p.set_input_files("#import-file", str(saved))
    p.wait_for_function("() => document.querySelectorAll('#conversations li').length === 1")
    p.click("#conversations button.conversation")
    assert p.locator(".msg.assistant .body strong").inner_text() == "me"
    with p.expect_download() as again:
        p.click("#export")
    again.value.save_as(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == exported

    # a file that is not an export is refused with a message, and changes nothing
    (tmp_path / "bad.json").write_text('{"conversations": 3}')
    p.set_input_files("#import-file", str(tmp_path / "bad.json"))
    p.wait_for_selector("#notice:not([hidden])")
    assert "not an llmrun conversation export" in p.inner_text("#notice")


# an image dropped on the message box, or pasted into it
DROP = """async (b64) => {
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], 'dropped.png', {type: 'image/png'}));
  document.getElementById('composer').dispatchEvent(
      new DragEvent('drop', {dataTransfer: data, bubbles: true, cancelable: true}));
}"""
PASTE = DROP.replace("'drop'", "'paste'").replace("DragEvent", "ClipboardEvent") \
    .replace("dataTransfer: data", "clipboardData: data").replace("'composer'", "'prompt'")


@needs_browser
def test_images_attach_to_a_vision_model_and_are_refused_for_a_text_model(
        page: Watched) -> None:
    p = page.page
    png = image(1)
    pick(page, "smollm2")
    p.set_input_files("#image-file", files=[{"name": "a.png", "mimeType": "image/png",
                                             "buffer": png}])
    p.wait_for_selector("#notice:not([hidden])")
    assert "cannot read images" in p.inner_text("#notice")
    assert p.locator("#attachments img").count() == 0

    pick(page, "vis")
    p.set_input_files("#image-file", files=[{"name": "a.png", "mimeType": "image/png",
                                             "buffer": png}])
    p.wait_for_function("() => document.querySelectorAll('#attachments img').length === 1")
    p.evaluate(DROP, base64.b64encode(image(2)).decode())
    p.wait_for_function("() => document.querySelectorAll('#attachments img').length === 2")
    p.evaluate(PASTE, base64.b64encode(image(3)).decode())
    p.wait_for_function("() => document.querySelectorAll('#attachments img').length === 3")
    p.get_by_role("button", name="Remove dropped.png").last.click()  # the pasted one goes
    p.wait_for_function("() => document.querySelectorAll('#attachments img').length === 2")
    settings(page, temperature=0, num_predict=8)
    answer = ask(page, "What is in these pictures?")
    assert answer.locator(".error").count() == 0
    assert answer.locator(".stats").count() == 1
    assert p.locator(".msg.user .images img").count() == 2
    p.wait_for_function("""() => [...document.querySelectorAll('.msg.user .images img')]
        .every(i => i.complete && i.naturalWidth === 32)""")  # shown, as the 32 px they are
    assert p.locator("#attachments img").count() == 0
    # the user message carried both images, as the daemon saw them: the context counts them
    stats = answer.locator(".stats").inner_text()
    used = int(stats.split("context ")[1].split(" ")[0])
    assert used > 2 * 16, stats  # 16 positions per image with the test projector


@needs_browser
def test_status_view_shows_and_unloads(page: Watched, web: Daemon) -> None:
    p = page.page
    pick(page, "fake")
    httpx.post(web.url + "/api/generate", json={"model": "smollm2"}, timeout=120)  # load it
    p.click("#status-open")
    row = p.locator("#status-rows tr", has_text="smollm2:latest")
    assert "2048" in row.inner_text()
    row.get_by_role("button", name="Unload smollm2:latest").click()
    p.wait_for_function("() => !document.querySelector('#status-rows').textContent"
                        ".includes('smollm2:latest')")
    assert "smollm2:latest" not in [m["name"] for m in
                                    httpx.get(web.url + "/api/ps").json()["models"]]
    p.keyboard.press("Escape")
    p.wait_for_selector("#status-dialog", state="hidden")


@needs_browser
def test_keys_are_asked_for_and_a_wrong_one_is_told(context: Any, keyed: Daemon) -> None:
    watched = Watched(context.new_page(), keyed.url,
                      # the browser logs each refused fetch (401) as a console error
                      allowed_errors=("status of 401",)).attach().open()
    p = watched.page
    p.wait_for_selector("#key-dialog[open]")
    assert p.locator("#key-error").is_hidden()
    p.fill("#key", "wrong-key")
    p.press("#key", "Enter")
    p.wait_for_selector("#key-error:not([hidden])")
    assert "invalid API key" in p.inner_text("#key-error")
    p.fill("#key", KEY)
    p.press("#key", "Enter")
    p.wait_for_selector("#key-dialog", state="hidden")
    assert p.locator("#model option").all_text_contents() == ["tiny:latest"]
    assert p.evaluate("sessionStorage.getItem('llmrun.key')") == KEY
    assert p.evaluate("localStorage.length") == 0  # the key is kept for the tab only

    # pulling, with the key, from the (fake) Hub, with its progress
    p.click("#pull-open")
    p.fill("#pull-name", "hf.co/org/tiny-GGUF")
    p.click("#pull-start")
    p.wait_for_function(
        "() => document.getElementById('pull-status').textContent.includes('ready')")
    assert p.locator("#pull-progress").is_visible()
    assert p.evaluate("document.getElementById('pull-progress').value") == \
        p.evaluate("document.getElementById('pull-progress').max") > 0
    p.click("#pull-dialog [data-close]")
    assert "hf.co/org/tiny-GGUF:latest" in p.locator("#model option").all_text_contents()
    watched.check()


def rounded(times: list[float]) -> list[float]:
    return [round(t, 1) for t in sorted(times)]


@needs_browser
def test_time_to_first_token_in_the_page_and_in_the_api(page: Watched, web: Daemon) -> None:
    """Measured and printed, not asserted (timed assertions fail on busy machines): from the
    click on Send to the first text on screen, and from the API request to its first chunk."""
    p = page.page
    pick(page, "smollm2")
    settings(page, temperature=0, num_predict=4)
    question = "Say hello."
    body = {"model": "smollm2:latest", "messages": [{"role": "user", "content": question}],
            "options": {"temperature": 0, "num_predict": 4}, "stream": True}
    ask(page, question)  # loaded, and the prompt's prefix cached, for both alike
    p.evaluate("""() => {
      document.getElementById('send').addEventListener('click', () => {
        window.clicked = performance.now(); window.first = null;
        const seen = new MutationObserver(() => {
          const b = [...document.querySelectorAll('.msg.assistant .body')].at(-1);
          if (window.first === null && b && b.textContent.trim()) {
            window.first = performance.now(); seen.disconnect(); }
        });
        seen.observe(document.getElementById('messages'),
                     {childList: true, subtree: true, characterData: true});
      }, true);
    }""")
    in_page: list[float] = []
    in_api: list[float] = []
    # one connection kept open, as the browser keeps its own; the API's turn first, so
    # neither meets the other's leftovers (the page is idle once Send is back)
    with httpx.Client(base_url=web.url, timeout=120) as client:
        for _ in range(5):
            t0 = time.perf_counter()
            with client.stream("POST", "/api/chat", json=body) as r:
                for line in r.iter_lines():
                    if json.loads(line)["message"]["content"]:
                        in_api.append((time.perf_counter() - t0) * 1000)
                        break
            p.click("#new-chat")
            settings(page, temperature=0, num_predict=4)
            p.fill("#prompt", question)
            p.click("#send")
            finished(page, 0)
            in_page.append(p.evaluate("window.first - window.clicked"))
    page_ms, api_ms = statistics.median(in_page), statistics.median(in_api)
    print(f"\ntime to first token, median of 5: page {page_ms:.1f} ms, API {api_ms:.1f} ms, "
          f"difference {page_ms - api_ms:+.1f} ms (page {rounded(in_page)}, API "
          f"{rounded(in_api)})")
    assert len(in_page) == len(in_api) == 5


@needs_browser
def test_screenshots(page: Watched) -> None:
    """docs/web/: a chat, light and dark, at desktop and phone width (390 px, an iPhone's)."""
    p = page.page
    pick(page, "smollm2")
    settings(page, temperature=0, seed=1, num_predict=120)
    answer = ask(page, "Write a Python function that reverses a string.")
    assert answer.locator(".stats").count() == 1
    SHOTS.mkdir(parents=True, exist_ok=True)
    for name, size in (("desktop", {"width": 1280, "height": 800}),
                       ("phone", {"width": 390, "height": 844})):
        p.set_viewport_size(size)
        for scheme in ("light", "dark"):
            p.emulate_media(color_scheme=scheme)
            background = p.evaluate("getComputedStyle(document.body).backgroundColor")
            assert (background == "rgb(255, 255, 255)") == (scheme == "light"), background
            p.screenshot(path=str(SHOTS / f"chat-{name}-{scheme}.png"))
    # at phone width the list of conversations is behind a button, and opens over the chat
    assert p.locator("#sidebar").is_hidden()
    p.click("#open-sidebar")
    p.wait_for_selector("#sidebar", state="visible")
    assert p.get_attribute("#open-sidebar", "aria-expanded") == "true"
