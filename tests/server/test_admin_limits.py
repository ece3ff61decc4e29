"""Admin profiles are bounded (issue #45, item 4), attacked as a token holder and a client would, on loopback against
real `toolquake serve` processes (one worker, and two sharing the profiles): 600 PUTs with the longest names allowed
stop at `[server] max_profiles` (default 256, for the whole proxy) with 409 `too_many_profiles`; names are bounded in
length and charset; `/metrics` holds at most one set of series per profile and a deleted profile's series are gone
(whichever worker served its requests or is scraped); the unknown-profile 404 any client can trigger names a handful
of the operator's profiles, never an admin-created one."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support import metric_samples, start_proxy
from tests.support.chat import body

TOKEN = "adm-limits-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
DEFAULT_MAX_PROFILES = 256
PUTS = 600
#: the operator's profiles (the config file's): besides `off`, these count towards max_profiles
CONFIG = """
[scoring]
enabled = false
[profiles.operator-a]
mode = "off"
[profiles.operator-b]
mode = "shadow"
"""
CONFIGURED = ("off", "operator-a", "operator-b")
#: the longest name allowed (64 characters), one per PUT
NAMES = [f"admin-made-{i:03d}-".ljust(64, "x") for i in range(PUTS)]
#: the most bytes an unknown-profile error may take (it named every profile before: 404 KB for 2,000)
SMALL_ERROR = 2048


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-worker", "two-workers"])
def proxy(request, fake_upstream):
    proc = start_proxy(fake_upstream.url, CONFIG, {"TOOLQUAKE_ADMIN_TOKEN": TOKEN}, "--workers", request.param)
    yield proc
    proc.stop()


def _profile_labels(client: httpx.Client) -> set[str]:
    text = client.get("/metrics").text
    return {dict(labels)["profile"] for _, labels in metric_samples(text) if "profile" in dict(labels)}


def _unknown_profile_errors(client: httpx.Client) -> list[httpx.Response]:
    """What a client without the admin token gets for a profile that does not exist (path and header)."""
    return [client.post("/p/no-such-profile/v1/chat/completions", json=body()),
            client.post("/v1/chat/completions", json=body(), headers={"X-Toolquake-Profile": "n" * 8000})]


def test_admin_profiles_are_bounded_and_leave_no_series_behind(proxy):
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        # the operator's profiles and the requests with no profile: their series are there from the start
        assert client.post("/p/operator-a/v1/chat/completions", json=body()).status_code == 200
        assert client.post("/p/no-such-profile/v1/chat/completions", json=body()).status_code == 404
        baseline = len(client.get("/metrics").content)

        # 600 PUTs: the proxy stops at max_profiles (the operator's two count), whichever worker takes them
        answers = [client.put(f"/admin/profiles/{name}", json={"mode": "off"}, headers=ADMIN) for name in NAMES]
        created = [name for name, r in zip(NAMES, answers) if r.status_code == 200]
        refused = [r for r in answers if r.status_code != 200]
        assert len(created) == DEFAULT_MAX_PROFILES - 2, [r.status_code for r in answers]
        assert len(refused) == PUTS - len(created)
        for r in refused:
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "too_many_profiles" and "max_profiles" in r.json()["error"]["message"]
        listed = client.get("/admin/profiles", headers=ADMIN).json()["profiles"]
        assert sorted(p["name"] for p in listed) == sorted([*CONFIGURED, *created])
        # replacing one that exists is not adding one
        assert client.put(f"/admin/profiles/{created[0]}", json={"mode": "shadow"}, headers=ADMIN).status_code == 200

        # names: bounded in length and charset (400, nothing created)
        for bad in ("n" * 65, "n" * 200, "a%20b", "caf%C3%A9", "-leading-dash", "%3Cnoise%3E"):
            r = client.put(f"/admin/profiles/{bad}", json={"mode": "off"}, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_profile", (bad, r.text)
            assert len(r.content) < SMALL_ERROR

        # every created profile serves a request: one set of series per profile, no more
        for name in created:
            r = client.post(f"/p/{name}/v1/chat/completions", json=body())
            assert r.status_code == 200, r.text
        shown = _profile_labels(client)
        assert set(created) <= shown
        assert len(shown) <= DEFAULT_MAX_PROFILES + 2  # "-" (no profile), and "<noise>" at most

        # an unknown profile, asked by a client without the token: a small error naming the operator's profiles only
        for r in _unknown_profile_errors(client):
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_profile"
            assert len(r.content) < SMALL_ERROR, len(r.content)
            message = r.json()["error"]["message"]
            assert "off" in message and "operator-a" in message
            assert "admin-made" not in message

        # every created profile deleted: its series are gone from /metrics (on every worker: each scrape reads them all)
        for name in created:
            assert client.delete(f"/admin/profiles/{name}", headers=ADMIN).status_code == 204
        assert client.post(f"/p/{created[0]}/v1/chat/completions", json=body()).status_code == 404
        for _ in range(8):
            with httpx.Client(base_url=proxy.url, timeout=30) as fresh:  # a new connection: either worker
                left = _profile_labels(fresh)
                assert not {name for name in left if name.startswith("admin-made")}, sorted(left)[:5]
                size = len(fresh.get("/metrics").content)
                assert size < baseline + 16 * 1024, (baseline, size)

        # and the room is back: a new profile can be made again
        assert client.put("/admin/profiles/after-the-purge", json={"mode": "off"}, headers=ADMIN).status_code == 200
        assert client.delete("/admin/profiles/after-the-purge", headers=ADMIN).status_code == 204


def test_a_config_with_more_profiles_than_max_profiles_is_refused(tmp_path):
    from toolquake.proxy.server.config import ConfigError, load_config

    path = tmp_path / "profiles.toml"
    path.write_text("[server]\nmax_profiles = 2\n" + "".join(f'[profiles.p{i}]\nmode = "off"\n' for i in range(3)))
    with pytest.raises(ConfigError, match="max_profiles"):
        load_config(path, env={})
    assert load_config(path, env={"TOOLQUAKE_MAX_PROFILES": "3"}).server.max_profiles == 3


@pytest.mark.parametrize("name", ["n" * 65, "a b", "café", "-dash", "x/y", "<noise>", "-", ""])
def test_profile_names_outside_the_charset_or_too_long_are_config_errors(tmp_path, name):
    from toolquake.proxy.server.config import ConfigError, load_config

    path = tmp_path / "profiles.toml"
    path.write_text(f'[profiles.{json.dumps(name)}]\nmode = "off"\n')
    with pytest.raises(ConfigError, match="invalid profile name"):
        load_config(path, env={})
