"""CORS for listed origins (issue 22, item 6) and the per-route HTTP counter (item 7).

Unit tests drive the middlewares over a tiny ASGI app (no model); one test builds the real app
without starting its engine; the last two start a real node and drive the system Chromium from
pages served on two other loopback ports: one a listed origin, one not.
"""

from __future__ import annotations

import functools
import http.server
import re
import threading
from collections.abc import Iterator

import pytest
from starlette.responses import JSONResponse
from starlette.routing import Match, Route
from starlette.testclient import TestClient

from edgellm.api.metrics import ServiceMetrics
from edgellm.runtime.server.cors import Cors
from edgellm.runtime.server.http_guard import CountResponses, Drain, GuardConfig, HttpGuard
from edgellm.runtime.settings import SettingsError, load_settings
from tests.console.conftest import chromium_path
from tests.nodeproc import NodeProcess
from tests.process_hygiene import release, watch_descendants

LISTED = "http://app.example:3000"
PREFLIGHT = {"origin": LISTED, "access-control-request-method": "POST"}
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the bundled model's served name


async def tiny_app(scope, receive, send):
    """Answers every request 200 with a Vary of its own (merged, not replaced, by Cors)."""
    assert scope["type"] == "http"
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"vary", b"Accept-Encoding")],
        }
    )
    await send({"type": "http.response.body", "body": b'{"ok": true}'})


def guarded(app) -> HttpGuard:
    def error_response(path, exc):
        return JSONResponse(exc.to_body(), status_code=exc.http_status, headers=exc.headers)

    config = GuardConfig(max_body_bytes=1024, body_timeout_s=5, loopback_only=True)
    return HttpGuard(app, config=config, drain=Drain(), error_response=error_response)


@pytest.fixture
def client() -> TestClient:
    """Cors outside HttpGuard, as app.py stacks them."""
    return TestClient(Cors(guarded(tiny_app), origins=[LISTED]), base_url="http://127.0.0.1:8765")


def cors_headers(response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


# -- the middleware ---------------------------------------------------------------------------
def test_a_listed_origin_is_granted_by_name_with_credentials(client):
    r = client.get("/x", headers={"origin": LISTED})
    assert r.status_code == 200
    assert cors_headers(r) == {
        "access-control-allow-origin": LISTED,
        "access-control-allow-credentials": "true",
        "access-control-expose-headers": "Retry-After",
    }
    assert r.headers["vary"] == "Accept-Encoding, Origin"


@pytest.mark.parametrize(
    "origin", ["http://evil.example:3000", "http://app.example:3001", "https://app.example:3000", "null"]
)
def test_an_unlisted_origin_gets_no_cors_headers(client, origin):
    r = client.get("/x", headers={"origin": origin})
    assert r.status_code == 200  # the request runs; the browser keeps the answer from the page
    assert cors_headers(r) == {}
    assert "Origin" in r.headers["vary"]
    assert cors_headers(client.get("/x")) == {}  # no Origin: not a CORS request


def test_a_preflight_from_a_listed_origin(client):
    r = client.options(
        "/v1/chat/completions",
        headers={**PREFLIGHT, "access-control-request-headers": "Content-Type, X-Evil, authorization"},
    )
    assert r.status_code == 204
    assert r.content == b""
    assert cors_headers(r) == {
        "access-control-allow-origin": LISTED,
        "access-control-allow-credentials": "true",
        "access-control-expose-headers": "Retry-After",
        "access-control-allow-methods": "GET, POST, DELETE, OPTIONS",
        "access-control-allow-headers": "authorization, content-type",  # not x-evil: it was not granted
        "access-control-max-age": "600",
    }
    assert "Origin" in r.headers["vary"]
    bare = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-headers" not in bare.headers  # nothing asked, nothing granted


def test_a_preflight_from_an_unlisted_origin_is_refused_without_cors_headers(client):
    r = client.options("/v1/chat/completions", headers={**PREFLIGHT, "origin": "http://evil.example"})
    assert r.status_code == 403
    assert cors_headers(r) == {}


def test_the_guard_still_refuses_and_its_refusals_carry_the_grant(client):
    origin = {"origin": LISTED}
    for response, status in [
        (client.post("/x", content=b"{}", headers={**origin, "content-type": "text/plain"}), 415),
        (
            client.post(
                "/x", content=b"{}", headers={**origin, "content-type": "application/json", "host": "evil.example"}
            ),
            421,
        ),
        (client.post("/x", content=b"x" * 2048, headers={**origin, "content-type": "application/json"}), 413),
    ]:
        assert response.status_code == status
        assert response.headers["access-control-allow-origin"] == LISTED
    r = client.post("/x", content=b"{}", headers={"origin": "http://evil.example", "content-type": "text/plain"})
    assert r.status_code == 415 and cors_headers(r) == {}
    assert client.post("/x", json={}, headers=origin).status_code == 200


def test_star_is_never_sent_nor_accepted():
    with pytest.raises(ValueError, match="never granted"):
        Cors(tiny_app, origins=["*"])
    c = TestClient(Cors(tiny_app, origins=[LISTED]))
    for origin in ("*", LISTED + "/", LISTED.upper()):  # an Origin is matched exactly as browsers send it
        r = c.get("/", headers={"origin": origin})
        assert cors_headers(r) == {}
        assert "*" not in r.headers.get("access-control-allow-origin", "")


# -- settings ---------------------------------------------------------------------------------
def test_cors_origins_from_env_file_and_flags(monkeypatch, tmp_path):
    assert load_settings().cors_origins == []
    monkeypatch.setenv("EDGELLM_CORS_ORIGINS", " http://a.local:3000 ,HTTPS://B.local:443,http://[::1]:8080 ")
    assert load_settings().cors_origins == ["http://a.local:3000", "https://b.local", "http://[::1]:8080"]
    monkeypatch.setenv("EDGELLM_CORS_ORIGINS", '["http://a.local"]')
    assert load_settings().cors_origins == ["http://a.local"]
    monkeypatch.delenv("EDGELLM_CORS_ORIGINS")
    cfg = tmp_path / "node.yaml"
    cfg.write_text("cors_origins: ['http://c.local:80', 'http://d.local/']\n")
    assert load_settings(str(cfg)).cors_origins == ["http://c.local", "http://d.local"]
    assert load_settings(cors_origins=["https://e.local:8443"]).cors_origins == ["https://e.local:8443"]


@pytest.mark.parametrize(
    "origin,fragment",
    [
        ("*", "wildcards are not allowed"),
        ("http://*.example.com", "wildcards are not allowed"),
        ("http://a.local/app", "has a path"),
        ("http://a.local?x=1", "has a path"),
        ("a.local:3000", "is not http(s)://host"),
        ("ftp://a.local", "is not http(s)://host"),
        ("null", "is not http(s)://host"),
        ("http://a.local:99999", "is not scheme://host"),
        ("http://u:p@a.local", "has credentials"),
    ],
)
def test_a_bad_origin_is_a_settings_error(monkeypatch, origin, fragment):
    with pytest.raises(SettingsError, match=re.escape(fragment)):
        load_settings(cors_origins=[origin])
    monkeypatch.setenv("EDGELLM_CORS_ORIGINS", f"http://ok.local,{origin}")
    with pytest.raises(SettingsError, match="cors_origins"):
        load_settings()


# -- the per-route counter --------------------------------------------------------------------
def test_every_response_is_counted_by_route_template_and_code():
    metrics = ServiceMetrics()

    async def ok(request):
        return JSONResponse({"ok": True})

    async def boom(request):
        raise RuntimeError("boom")

    routes = [Route("/v1/chat/completions", ok, methods=["POST"]), Route("/items/{name}", ok), Route("/boom", boom)]

    async def router(scope, receive, send):
        for route in routes:
            match, child = route.matches(scope)
            if match is not Match.NONE:
                scope.update(child)
                await route.handle(scope, receive, send)
                return
        await JSONResponse({"error": "nope"}, status_code=404)(scope, receive, send)

    app = CountResponses(Cors(guarded(router), origins=[LISTED]), routes=routes, count=metrics.count_http)
    c = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)
    c.post("/v1/chat/completions", json={})
    c.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
    c.options("/v1/chat/completions", headers=PREFLIGHT)
    c.get("/items/a")
    c.get("/items/b")
    c.get("/no/such/path")
    c.get("/another/unknown")
    c.get("/boom")
    assert metrics.http_counts() == {
        "/boom": {"500": 1},
        "/items/{name}": {"200": 2},
        "/v1/chat/completions": {"200": 1, "204": 1, "415": 1},
        "other": {"404": 2},
    }
    text = metrics.prometheus_text().decode()
    assert 'edgellm_http_requests_total{code="204",route="/v1/chat/completions"} 1.0' in text
    assert metrics.as_dict()["http_requests"] == metrics.http_counts()


def test_the_app_stacks_counter_cors_and_guard(tmp_path):
    """The real app, engine not started (no lifespan): routes that need no engine, and refusals."""
    from edgellm.runtime.server.app import create_app

    app = create_app(load_settings(state_dir=str(tmp_path), cors_origins=[LISTED]))
    c = TestClient(app, base_url="http://127.0.0.1:8765")
    pre = c.options("/v1/chat/completions", headers={**PREFLIGHT, "access-control-request-headers": "content-type"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == LISTED
    refused = c.post("/v1/chat/completions", content=b"{}", headers={"origin": LISTED, "content-type": "text/plain"})
    assert refused.status_code == 415 and refused.headers["access-control-allow-origin"] == LISTED
    assert c.get("/nope", headers={"origin": LISTED}).status_code == 404
    counts = app.state.service.instruments.http_counts()
    assert counts["/v1/chat/completions"] == {"204": 1, "415": 1}
    assert counts["other"] == {"404": 1}
    plain = create_app(load_settings(state_dir=str(tmp_path / "plain")))
    r = TestClient(plain, base_url="http://127.0.0.1:8765").get("/nope", headers={"origin": LISTED})
    assert "access-control-allow-origin" not in r.headers and "vary" not in r.headers  # off by default


# -- a real node and a real browser -----------------------------------------------------------
def serve_page(folder) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def origins(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """Two loopback web origins serving the same page: the first is listed, the second is not."""
    folder = tmp_path_factory.mktemp("cors-page")
    (folder / "page.html").write_text("<!doctype html><title>cors</title><p>a page of another origin</p>")
    servers = [serve_page(folder), serve_page(folder)]
    yield tuple(f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.fixture(scope="module")
def cors_node(tmp_path_factory, origins):
    node = NodeProcess(tmp_path_factory.mktemp("cors-node"), env={"EDGELLM_CORS_ORIGINS": origins[0]}).start()
    yield node
    node.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        watched = watch_descendants()  # the driver and the browser die with the test run
        yield instance
        instance.close()
    for ident in watched:
        release(ident)


FETCH = """async ([url, contentType, model]) => {
  try {
    const r = await fetch(url, {method: 'POST', headers: {'content-type': contentType},
      body: JSON.stringify({model, messages: [{role: 'user', content: 'Say hi.'}], max_tokens: 4})});
    return {status: r.status, body: await r.json()};
  } catch (e) {
    return {error: e.name + ': ' + e.message};
  }
}"""


def test_the_node_answers_a_listed_origins_page_in_a_browser(browser, cors_node, origins):
    listed, unlisted = origins
    url = cors_node.base + "/v1/chat/completions"
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(listed + "/page.html")
        answer = page.evaluate(FETCH, [url, "application/json", MODEL])  # not a simple request: preflighted
        assert answer.get("status") == 200, answer
        assert answer["body"]["choices"][0]["message"]["role"] == "assistant"
        refused = page.evaluate(FETCH, [url, "text/plain", MODEL])  # simple: no preflight, the guard's 415, readable
        assert refused.get("status") == 415, refused
        page.goto(unlisted + "/page.html")
        for content_type in ("application/json", "text/plain"):
            blocked = page.evaluate(FETCH, [url, content_type, MODEL])
            assert blocked.get("error", "").startswith("TypeError"), blocked
    finally:
        context.close()


def test_the_node_counts_responses_by_route_and_code(cors_node, origins):
    with cors_node.client() as c:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        c.options("/v1/chat/completions", headers={"origin": origins[1], "access-control-request-method": "POST"})
        c.get("/no/such/path")
        text = c.get("/metrics", params={"format": "prometheus"}).text
        view = c.get("/metrics").json()["result"]["http_requests"]
    assert re.search(r'edgellm_http_requests_total\{code="200",route="/v1/chat/completions"\} [1-9]', text), text
    assert re.search(r'edgellm_http_requests_total\{code="403",route="/v1/chat/completions"\} [1-9]', text)
    assert re.search(r'edgellm_http_requests_total\{code="404",route="other"\} [1-9]', text)
    assert view["/v1/chat/completions"]["200"] >= 1
    assert view["/health"]["200"] >= 1  # wait_ready's polls
    assert "/no/such/path" not in view and view["other"]["404"] >= 1  # unknown paths: one bounded label
