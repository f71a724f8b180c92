"""One API key for everything: the API, /metrics, the Gradio UI and its API; the login page and its cookie; the
rule for non-loopback binds; CLI mistakes end in one line and exit code 2."""
import httpx
import pytest
from fastapi import FastAPI
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from engine.entrypoints.openai.auth import COOKIE, ApiKeyMiddleware, check_exposure, is_loopback

KEY = "sekret"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded():
    """A FastAPI app with a sub-app mounted at "/" (as app.py mounts Gradio), guarded by the key."""
    ui = FastAPI()
    ui.add_api_route("/", lambda: PlainTextResponse("the page"))
    ui.add_api_route("/gradio_api/info", lambda: {"named_endpoints": {}})
    app = FastAPI()
    app.add_api_route("/health", lambda: {"status": "ok"})
    app.add_api_route("/v1/models", lambda: {"data": []})
    app.mount("/", ui)
    app.add_middleware(ApiKeyMiddleware, api_key=KEY)
    return TestClient(app, follow_redirects=False)


@pytest.mark.parametrize("path", ["/", "/gradio_api/info", "/v1/models"])
def test_every_path_needs_the_key(guarded, path):
    r = guarded.get(path)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert guarded.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert guarded.get(path, headers=BEARER).status_code == 200


def test_health_stays_open(guarded):
    assert guarded.get("/health").status_code == 200


def test_browser_goes_through_the_login_page(guarded):
    r = guarded.get("/?x=1", headers={"Accept": "text/html"})
    assert r.status_code == 303 and r.headers["location"] == "/login?next=/%3Fx%3D1"
    page = guarded.get("/login?next=/")
    assert page.status_code == 200 and 'type="password"' in page.text
    bad = guarded.post("/login", data={"key": "nope", "next": "/"})
    assert bad.status_code == 401 and "Wrong key" in bad.text and COOKIE not in bad.headers.get("set-cookie", "")
    ok = guarded.post("/login", data={"key": KEY, "next": "//evil.example/"})
    assert ok.status_code == 303 and ok.headers["location"] == "/"          # never off this server
    cookie = ok.headers["set-cookie"]
    assert KEY not in cookie and "HttpOnly" in cookie and "SameSite=Lax" in cookie
    value = cookie.split(";")[0].split("=", 1)[1]
    for cookie_value, status in ((value, 200), (value[:-1] + ("0" if value[-1] != "0" else "1"), 401)):
        fresh = TestClient(guarded.app, follow_redirects=False, cookies={COOKIE: cookie_value})
        assert fresh.get("/gradio_api/info").status_code == status


def test_non_loopback_bind_needs_key_or_flag():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("192.168.1.5")
    assert check_exposure("127.0.0.1", None, False) is None
    assert check_exposure("0.0.0.0", KEY, False) is None
    with pytest.raises(ValueError, match=r"--host 0.0.0.0: .*--api-key KEY, or --allow-unauthenticated"):
        check_exposure("0.0.0.0", None, False)
    assert "WARNING" in check_exposure("0.0.0.0", None, True)


# ------------------------------------------------------------------------------ CLI mistakes: one line, exit 2
@pytest.mark.parametrize("argv, words", [
    (["--port", "99999"], "--port: must be in [0, 65535]"),
    (["--set", "num_kv_blocks=abc"], "--set: "),
    (["--set", "nonsense"], "expected FIELD=VALUE"),
    (["--host", "0.0.0.0"], "--allow-unauthenticated"),
    (["--header-timeout", "-1"], "header_timeout_s: must be > 0"),
], ids=["port", "set-value", "set-form", "exposed", "timeout"])
def test_app_cli_mistakes_exit_2_with_one_line(capsys, argv, words):
    import app
    with pytest.raises(SystemExit) as e:
        app.main(argv + ["--model", "dummy:tiny"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err and words in err, err


def test_app_cli_missing_model_exits_2(capsys):
    import app
    with pytest.raises(SystemExit) as e:
        app.main(["--model", "/nonexistent", "--device", "cpu", "--port", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine could not start" in err[0] and "/nonexistent" in err[0], err


@pytest.mark.parametrize("argv, words", [
    (["--port", "-5"], "--port: must be in [0, 65535]"),
    (["--host", "0.0.0.0", "--model", "dummy:tiny"], "--allow-unauthenticated"),
    (["--num-kv-blocks", "1", "--model", "dummy:tiny"], "num_kv_blocks"),
    (["--stream-interval", "0", "--model", "dummy:tiny"], "--stream-interval: must be >= 1"),
    (["--stream-interval-ms", "2000", "--model", "dummy:tiny"], "--stream-interval-ms: must be in [0, 1000.0]"),
    (["--stream-interval-ms", "soon", "--model", "dummy:tiny"], "--stream-interval-ms: must be a number in"),
], ids=["port", "exposed", "config", "stream-interval", "stream-interval-ms", "stream-interval-ms-word"])
def test_api_server_cli_mistakes_exit_2(capsys, argv, words):
    from engine.entrypoints.openai.api_server import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


# ------------------------------------------------------------------------------ the real app: Gradio behind the key
@pytest.mark.slow
def test_app_ui_and_gradio_api_need_the_key():
    import app
    from engine import EngineConfig
    from webui.host import EngineHost
    host = EngineHost(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=32))
    host.api_options = {"api_key": KEY}
    host.start(inspect=False)
    srv = app.serve_in_thread(host)
    try:
        url = srv.url.rstrip("/")
        for path in ("/", "/gradio_api/info", "/config", "/healthz", "/metrics", "/v1/models"):
            assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + "/gradio_api/info", headers=BEARER).status_code == 200
        r = httpx.post(url + "/gradio_api/call/apply_settings", json={"data": []})
        assert r.status_code == 401
        assert httpx.get(url + "/", headers={"Accept": "text/html"}).status_code == 303
        login = httpx.post(url + "/login", data={"key": KEY, "next": "/"})
        assert login.status_code == 303
        page = httpx.get(url + "/", cookies=login.cookies)
        assert page.status_code == 200 and "gradio" in page.text.lower()
        assert httpx.get(url + "/health").status_code == 200
    finally:
        srv.stop()
        host.shutdown()
