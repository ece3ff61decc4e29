"""Paths outside the API never reach the backend (proxy/server/paths.py): a path with a dot segment (spelled or
encoded), an encoded `/`, `?`, `#`, backslash or `%`, or a NUL gets 400 `invalid_path` and nothing is sent, on
every route (passthrough, backend extras, the model routes on the lean path and the framework's), through every
upstream client (`[server] upstream_client`) and to an `https://` backend (a local TLS server with a self-signed
certificate); and `[server] passthrough` names what is relayed: a backend's admin routes get 404 `not_found`
unless the operator lists them, the listed routes pass with their query strings intact. Every attack is sent as a
raw request line over a socket (HTTP clients normalise paths before sending), and the fake backend is asked
what it received."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.support import Proc, metric_value, recorded, start_fake_upstream, start_proxy
from tests.support.chat import body, tag

CONFIG = """
[server]
upstream_client = "{client}"
lean_path = {lean_path}
lean_protocol = {lean_protocol}
{extra}
[scoring]
enabled = false
[profiles.reversed]
mode = "perturb"
perturbers = [{{ name = "tool_order", params = {{ mode = "reverse" }} }}]
"""
#: arm → (upstream_client, TLS backend, lean_path, lean_protocol)
ARMS = {
    "native": ("native", False, "true", "true"),
    "aiohttp": ("aiohttp", False, "true", "true"),
    "httpx": ("httpx", False, "true", "true"),
    "native-https": ("native", True, "true", "true"),
    "aiohttp-https": ("aiohttp", True, "true", "true"),
    "lean-asgi": ("native", False, "true", "false"),
    "framework": ("native", False, "false", "true"),
}
#: (method, request target as sent on the request line): every one must get 400 invalid_path, nothing sent
ATTACKS = [
    ("GET", "/v1/%2e%2e%2fmetrics"),
    ("POST", "/extras/..%2fsleep?level=1"),
    ("GET", "/p/off/v1/%2e%2e/%2e%2e/metrics"),
    ("POST", "/p/off/v1/%2e%2e/%2e%2e/reset_prefix_cache"),
    ("GET", "/v1/%2e%2e/_fake/requests"),  # the fake backend's log: every client's Authorization and prompt
    ("GET", "/extras/%2E%2E/_fake/requests"),
    ("GET", "/v1/../metrics"),
    ("GET", "/v1/models/../../metrics"),
    ("GET", "/v1/models/./x"),
    ("GET", "/v1/models/%2e"),
    ("GET", "/v1/models/.%2E"),
    ("GET", "/v1/models%2f..%2f..%2fmetrics"),
    ("POST", "/v1/models%2F..%2Fload_lora_adapter"),
    ("GET", "/v1/models%5c..%5cmetrics"),
    ("GET", "/v1/models\\..\\metrics"),
    ("GET", "/v1/models%00"),
    ("GET", "/v1/models%3Fx=1"),
    ("GET", "/v1/models%23frag"),
    ("GET", "/v1/%252e%252e%252fmetrics"),  # a second layer of escapes, for a backend that decodes twice
    ("GET", "/p/off/v1/models%2f..%2fx"),
    ("GET", "/p/off/v1/models%3Fa=b"),
    ("GET", "/extras/tokenize%2f..%2f..%2fsleep"),
    ("GET", "/extras/%2e%2e/%2e%2e/metrics"),
    ("POST", "/extras/tokenize/count%00"),
    ("POST", "/extras/tokenize/count%23x"),
    ("POST", "/tokenize%3Fa=b"),
    ("POST", "/tokenize/%2e%2e/sleep"),
    ("POST", "/tokenize%2f..%2fsleep"),
    ("POST", "/tokenize%5c"),
    # the model routes: the lean path (profile off) and the framework's (a perturbing profile)
    ("POST", "/v1/chat%2fcompletions"),
    ("POST", "/p/off/v1/chat%2Fcompletions"),
    ("POST", "/p/reversed/v1/chat%2fcompletions"),
    ("POST", "/v1/./chat/completions"),
    ("POST", "/p/off/v1/models/../chat/completions"),
    ("POST", "/v1/responses%00"),
]
#: another client's secret, sent before the attacks: no answer to an attack may carry it
SECRET = "Bearer sk-other-client-secret-0123456789"


def _cert(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture(scope="module")
def tls_upstream(tmp_path_factory) -> Iterator[tuple[Proc, Path]]:
    cert, key = _cert(tmp_path_factory.mktemp("tls"))
    fake = start_fake_upstream("--tls", str(cert), str(key))
    yield fake, cert
    fake.stop()


@pytest.fixture(scope="module", params=list(ARMS))
def arm(request, fake_upstream) -> Iterator[Any]:
    client, tls, lean_path, lean_protocol = ARMS[request.param]
    fake, env = fake_upstream, None
    if tls:
        fake, cert = request.getfixturevalue("tls_upstream")
        env = {"SSL_CERT_FILE": str(cert)}  # the proxy trusts the test's certificate, as it would a real CA's
    proc = start_proxy(fake.url, CONFIG.format(client=client, lean_path=lean_path, lean_protocol=lean_protocol,
                                               extra=""), env)
    proc.fake = fake  # type: ignore[attr-defined]
    yield proc
    proc.stop()


def _send(proc: Proc, method: str, target: str, headers: dict[str, str] | None = None,
          data: bytes = b"") -> tuple[int, bytes]:
    """One request written as it is on the request line (no client normalises it); the status and body."""
    port = int(proc.url.rsplit(":", 1)[1])
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}Content-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode("latin-1") + data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _received(proc: Any, t: str) -> list[tuple[str, str, str]]:
    """What the backend received with tag `t`: (method, raw path, query)."""
    return [(r["method"], r["raw_path"], r["query"]) for r in recorded(proc.fake, t)]


def _marker(proc: Any, t: str) -> None:
    """A plain request with tag `t` the backend must receive: once it has, whatever came before did arrive."""
    status, _ = _send(proc, "GET", "/v1/models", {"X-Test-Tag": t})
    assert status == 200


@pytest.mark.parametrize("method,target", ATTACKS, ids=[f"{m} {t}" for m, t in ATTACKS])
def test_a_path_outside_the_api_is_refused_and_nothing_is_sent(arm, method, target):
    t = tag()
    _send(arm, "POST", "/v1/embeddings", {"Authorization": SECRET, "X-Test-Tag": tag()},
          json.dumps({"model": "fake-model", "input": "another client's prompt"}).encode())
    data = json.dumps(body()).encode() if method == "POST" else b""
    status, answer = _send(arm, method, target, {"X-Test-Tag": t, "Authorization": "Bearer sk-attacker"}, data)
    assert status == 400, (status, answer[:300])
    error = json.loads(answer)["error"]
    assert error["code"] == "invalid_path" and error["type"] == "invalid_request_error", error
    assert SECRET.encode() not in answer
    _marker(arm, t)
    assert _received(arm, t) == [("GET", "/v1/models", "")]


#: listed by default: (method, target, the raw path and query the backend must receive)
LISTED = [
    ("GET", "/v1/models?limit=2&after=a%20b", "/v1/models", "limit=2&after=a%20b"),
    ("POST", "/v1/embeddings?x=1", "/v1/embeddings", "x=1"),
    ("GET", "/v1/files/file-a%20b/content?x=%2F", "/v1/files/file-a%20b/content", "x=%2F"),
    ("GET", "/v1/models/gpt%2e4", "/v1/models/gpt.4", ""),
    ("POST", "/p/off/v1/embeddings?y=2", "/v1/embeddings", "y=2"),
    ("POST", "/tokenize?verbose=1", "/tokenize", "verbose=1"),
    ("POST", "/detokenize", "/detokenize", ""),
    ("POST", "/extras/tokenize/count?a=b&c=d", "/extras/tokenize/count", "a=b&c=d"),
]
#: a backend's own admin routes and extras, not listed by default
UNLISTED = [("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/p/off/v1/rerank"),
            ("GET", "/v1/no/such/route"), ("POST", "/sleep?level=1"), ("POST", "/reset_prefix_cache"),
            ("POST", "/wake_up")]


def test_listed_routes_pass_with_their_query_and_a_backends_admin_routes_do_not(arm):
    t = tag()
    for method, target, path, query in LISTED:
        status, answer = _send(arm, method, target, {"X-Test-Tag": t}, b'{"input": "hi"}' if method == "POST" else b"")
        assert status in (200, 404), (target, status, answer[:300])  # 404: the fake backend's own, relayed
    for method, target in UNLISTED:
        status, answer = _send(arm, method, target, {"X-Test-Tag": t}, b"{}")
        assert status == 404, (target, status, answer[:300])
        error = json.loads(answer)["error"]
        assert error["code"] == "not_found" and "[server] passthrough" in error["message"], (target, error)
    _marker(arm, t)
    assert _received(arm, t) == [(m, path, query) for m, _, path, query in LISTED] + [("GET", "/v1/models", "")]


def test_the_operator_lists_a_backends_admin_routes(proxy_factory, fake_upstream):
    listed = 'passthrough = ["/v1/models", "/v1/load_lora_adapter", "/sleep", "/reset_prefix_cache", "/extras/*"]'
    proc = proxy_factory(CONFIG.format(client="native", lean_path="true", lean_protocol="true", extra=listed))
    proc.fake = fake_upstream  # type: ignore[attr-defined]
    t = tag()
    for method, target in [("POST", "/v1/load_lora_adapter"), ("POST", "/sleep?level=1"),
                           ("POST", "/reset_prefix_cache"), ("GET", "/extras/x/y?z=1")]:
        status, answer = _send(proc, method, target, {"X-Test-Tag": t}, b"{}")
        assert status == 404 and b"no route" in answer, (target, status, answer)  # the fake backend's own 404
    for method, target in [("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("POST", "/wake_up"),
                           ("GET", "/sleep/x")]:  # no longer (or never) listed
        status, answer = _send(proc, method, target, {"X-Test-Tag": t}, b"{}")
        assert status == 404 and json.loads(answer)["error"]["code"] == "not_found", (target, status, answer)
    _marker(proc, t)
    assert _received(proc, t) == [("POST", "/v1/load_lora_adapter", ""), ("POST", "/sleep", "level=1"),
                                  ("POST", "/reset_prefix_cache", ""), ("GET", "/extras/x/y", "z=1"),
                                  ("GET", "/v1/models", "")]


def test_refused_paths_are_counted(arm):
    before = metric_value(httpx.get(f"{arm.url}/metrics").text, "toolquake_connections_rejected_total",
                          reason="invalid_path")
    assert _send(arm, "GET", "/v1/%2e%2e/metrics")[0] == 400
    after = metric_value(httpx.get(f"{arm.url}/metrics").text, "toolquake_connections_rejected_total",
                         reason="invalid_path")
    assert after == before + 1


@pytest.mark.parametrize("entry,why", [
    ("sleep", "must start with '/'"), ("/*", "must start with '/'"), ("/v1/../metrics", "dot segment"),
    ("/v1//x", "empty or dot segment"), ("/v1/%2e", "only letters"), ("/v1/*/x", "only letters"),
    ("/metrics", "proxy's own /metrics"), ("/admin/*", "proxy's own /admin"), ("/v1", "names /v1 itself"),
])
def test_a_bad_passthrough_entry_is_refused_at_load(entry, why):
    from toolquake.proxy.server.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="passthrough entry") as info:
        load_config(env={"TOOLQUAKE_PASSTHROUGH": f"/v1/models,{entry}"})
    assert why in str(info.value) and repr(entry) in str(info.value)
