"""The admin token changes profiles, never hosts, paths, environment variables or secrets (issue #28, item 5).

Parameters that name where prompts go, where files land or which environment variable is sent as a key are
declared operator-only on their perturber (`Perturber.operator_only`); the admin API refuses a PUT that sets one
(403) and changes nothing, while the same parameters in the config file keep working. GET shows URLs without
their credentials.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any, ClassVar

import httpx
import msgspec
import pytest

TOKEN = "adm-h3-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
#: parts of a parameter name that say it names a place, a variable or a secret
MARKERS = ("url", "uri", "host", "dir", "path", "env", "key", "file", "endpoint", "secret", "password", "credential")


def names_a_place(name: str, annotation: Any) -> bool:
    lowered = name.lower()
    if any(m in lowered for m in MARKERS):
        return True
    # "token" but not "tokens" (budget_tokens is a count)
    at = lowered.find("token")
    while at != -1:
        if not lowered.startswith("tokens", at):
            return True
        at = lowered.find("token", at + 1)
    return annotation is Path or "Path" in str(annotation)


def undeclared(cls: type) -> list[str]:
    return [f.name for f in msgspec.structs.fields(cls)
            if names_a_place(f.name, f.type) and f.name not in cls.operator_only]


class Listener:
    """A TCP listener that counts the connections it gets (the host an admin would like prompts sent to)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def listener():
    found = Listener()
    yield found
    found.close()


def chat(proxy, profile: str) -> httpx.Response:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "Book a table for 2 at 7pm."}]}
    return httpx.post(f"{proxy.url}/p/{profile}/v1/chat/completions", json=body, timeout=30)


def test_every_parameter_naming_a_place_is_declared_operator_only():
    from toolquake import remedies
    from toolquake.perturbers import registry

    steps = {**registry(), **remedies.registry()}  # the remedies' parameters too (the admin API sets both)
    found = {name: undeclared(cls) for name, cls in steps.items()}
    assert {name: bad for name, bad in found.items() if bad} == {}
    for name, cls in steps.items():  # declarations name real parameters
        assert cls.operator_only <= {f.name for f in msgspec.structs.fields(cls)}, name
    assert registry()["paraphrase"].operator_only >= {"generator_url", "cache_dir", "api_key_env"}
    assert registry()["toolkit_expansion"].operator_only >= {"generator_url", "cache_dir", "api_key_env"}


def test_the_scan_catches_a_perturber_that_forgets_the_declaration():
    from toolquake.perturbers import Perturber

    class Careless(Perturber):
        name: ClassVar[str] = "careless"
        webhook_endpoint: str = ""
        output_file: str = ""
        auth_token: str = ""
        budget_tokens: int = 10

    class Careful(Careless):
        operator_only: ClassVar[frozenset[str]] = frozenset({"webhook_endpoint", "output_file", "auth_token"})

    assert undeclared(Careless) == ["webhook_endpoint", "output_file", "auth_token"]
    assert undeclared(Careful) == []


def test_admin_put_of_operator_only_parameters_is_refused_and_reaches_nothing(proxy_factory, listener, tmp_path):
    evil_dir = tmp_path / "admin-chosen"
    proxy = proxy_factory(None, {"TOOLQUAKE_ADMIN_TOKEN": TOKEN, "H3_OTHER_SECRET": "sk-h3-not-for-admins",
                                 "TOOLQUAKE_GENERATOR_URL": "", "TOOLQUAKE_CACHE": str(tmp_path / "cache")})
    url = f"{proxy.url}/admin/profiles"
    before = httpx.get(url, headers=ADMIN).json()
    attempts = [
        ("paraphrase", {"generator_url": listener.url}, "generator_url"),
        ("paraphrase", {"api_key_env": "H3_OTHER_SECRET"}, "api_key_env"),
        ("paraphrase", {"cache_dir": str(evil_dir)}, "cache_dir"),
        ("paraphrase", {"generator_url": listener.url, "api_key_env": "H3_OTHER_SECRET", "cache_dir": str(evil_dir)},
         "generator_url"),
        ("toolkit_expansion", {"source": "generate", "generator_url": listener.url, "generator_model": "m"},
         "generator_url"),
        ("toolkit_expansion", {"cache_dir": str(evil_dir)}, "cache_dir"),
        ("response_lengthening", {"live_records": "process"}, "live_records"),
    ]
    for perturber, params, named in attempts:
        spec = {"perturbers": [{"name": "tool_order"}, {"name": perturber, "params": params}]}
        r = httpx.put(f"{url}/stolen", json=spec, headers=ADMIN)
        assert r.status_code == 403, (perturber, params, r.text)
        error = r.json()["error"]
        assert error["code"] == "operator_only_parameter" and error["type"] == "permission_error"
        assert f"'{named}'" in error["message"] and "perturbers[1]" in error["message"]
        assert "config file" in error["message"] and "environment" in error["message"]
        assert httpx.get(f"{url}/stolen", headers=ADMIN).status_code == 404
        assert chat(proxy, "stolen").status_code == 404
    assert httpx.get(url, headers=ADMIN).json() == before
    assert listener.connections == 0 and not evil_dir.exists()
    assert "sk-h3-not-for-admins" not in proxy.output()

    # the same perturbers without those parameters (or with their defaults) are the admin's to add
    for spec in ({"perturbers": [{"name": "paraphrase", "params": {"timeout_s": 5, "api_key_env":
                                                                     "TOOLQUAKE_GENERATOR_API_KEY"}}]},
                 {"perturbers": [{"name": "response_lengthening", "params": {"live_records": "request"}}]}):
        r = httpx.put(f"{url}/allowed", json=spec, headers=ADMIN)
        assert r.status_code == 200, r.text
    assert listener.connections == 0


def test_operator_only_parameters_from_the_config_file_work_and_are_not_echoed(proxy_factory, fake_upstream,
                                                                               tmp_path):
    port = fake_upstream.url.rsplit(":", 1)[1]
    cache = tmp_path / "operator-cache"
    generator = f"http://gen-user:pw-h3-hidden@127.0.0.1:{port}/v1"
    operator_params = {"generator_url": generator, "generator_model": "fake-model", "cache_dir": str(cache),
                       "api_key_env": "H3_GEN_KEY"}
    config = f"""
[profiles.rephrase]
perturbers = [{{ name = "paraphrase", params = {{ generator_url = "{generator}", generator_model = "fake-model", \
cache_dir = "{cache}", api_key_env = "H3_GEN_KEY" }} }}]
"""
    proxy = proxy_factory(config, {"TOOLQUAKE_ADMIN_TOKEN": TOKEN, "H3_GEN_KEY": "sk-h3-operator-key"})
    assert chat(proxy, "rephrase").status_code == 200
    assert list(cache.rglob("*.json")), "the operator's cache_dir was not used"  # the rephrasing was cached there

    listed = httpx.get(f"{proxy.url}/admin/profiles", headers=ADMIN)
    one = httpx.get(f"{proxy.url}/admin/profiles/rephrase", headers=ADMIN)
    for r in (listed, one):
        assert r.status_code == 200
        assert "pw-h3-hidden" not in r.text and "gen-user" not in r.text and "sk-h3-operator-key" not in r.text
        assert "H3_GEN_KEY" in r.text  # the variable's name is no secret
    params = one.json()["perturbers"][0]["params"]
    assert params["generator_url"] == f"http://***@127.0.0.1:{port}/v1"

    url = f"{proxy.url}/admin/profiles"
    # the operator's values, sent back unchanged for the same step of the same profile: allowed
    same = {"perturbers": [{"name": "paraphrase", "params": operator_params, "probability": 0.5}]}
    r = httpx.put(f"{url}/rephrase", json=same, headers=ADMIN)
    assert r.status_code == 200, r.text
    # ... but not moved to another profile, not changed, not mixed with a default (its key to another host)
    for name, params in (("copy", operator_params),
                         ("rephrase", {**operator_params, "api_key_env": "HOME"}),
                         ("rephrase", {k: v for k, v in operator_params.items() if k != "api_key_env"}),
                         ("rephrase", {**operator_params, "generator_url": params["generator_url"]})):
        r = httpx.put(f"{url}/{name}", json={"perturbers": [{"name": "paraphrase", "params": params}]},
                      headers=ADMIN)
        assert r.status_code == 403, (name, params)
    got = httpx.get(f"{url}/rephrase", headers=ADMIN).json()
    assert got["perturbers"][0]["probability"] == 0.5 and got["perturbers"][0]["params"]["api_key_env"] == "H3_GEN_KEY"
    assert httpx.get(f"{url}/copy", headers=ADMIN).status_code == 404
