"""Fuzzing the live proxy: hypothesis-generated chat-completions bodies (wrong types, huge and deeply
nested values, invalid UTF-8, duplicate keys, tools with broken schemas), each sent through a profile
drawn from every profile the shipped config defines. No 5xx may originate in the proxy, the proxy
never crashes, and no perturber exception escapes (they are counted, the request is still served).

`TOOLQUAKE_FUZZ_EXAMPLES` sets the number of cases (1,000 by default; the documented long run uses
100,000).
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import metric_value

EXAMPLES = int(os.environ.get("TOOLQUAKE_FUZZ_EXAMPLES", "1000"))
PROFILES = [
    "off",
    *tomllib.loads((Path(__file__).resolve().parents[2] / "proxy" / "profiles.toml").read_text())["profiles"],
]

leaf = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=40)
json_value = st.recursive(
    leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=20
)
type_name = st.sampled_from(
    ["string", "integer", "number", "boolean", "array", "object", "dict", "float", "tuple", "any", "null", "nonsense"]
)
schema = st.recursive(
    st.fixed_dictionaries(
        {"type": type_name},
        optional={"description": st.text(max_size=30), "enum": st.lists(leaf, max_size=3), "default": leaf},
    ),
    lambda c: st.fixed_dictionaries(
        {"type": st.sampled_from(["object", "array", "dict"])},
        optional={
            "properties": st.dictionaries(st.text(min_size=1, max_size=10), c, max_size=4),
            "items": c,
            "required": st.lists(st.text(max_size=8), max_size=3),
        },
    ),
    max_leaves=8,
) | json_value.filter(lambda v: isinstance(v, dict))
name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,30}", fullmatch=True) | st.text(min_size=1, max_size=20)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": name}, optional={"description": st.text(max_size=60) | st.none(), "parameters": schema}
        ),
    }
)
tool_call = st.fixed_dictionaries(
    {
        "id": st.text(max_size=10),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": name, "arguments": st.text(max_size=60) | json_value.map(json.dumps)}
        ),
    }
)
content = (
    st.text(max_size=300)
    | st.none()
    | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=50)}), max_size=3)
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer"]), "content": content},
    optional={
        "tool_calls": st.lists(tool_call, max_size=2),
        "tool_call_id": st.text(max_size=8),
        "name": st.text(max_size=8),
    },
)
body = st.fixed_dictionaries(
    {"model": st.sampled_from(["fake-model", "m"]), "messages": st.lists(message, min_size=1, max_size=6)},
    optional={
        "tools": st.lists(tool, max_size=6),
        "stream": st.booleans(),
        "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_value,
        "temperature": st.floats(0, 2),
        "vendor_field": json_value,
    },
)
# wrong types for known fields, at the top level
wrong = st.fixed_dictionaries(
    {"messages": json_value}, optional={"tools": json_value, "stream": json_value, "model": json_value}
)


@st.composite
def raw_bodies(draw) -> bytes:
    kind = draw(
        st.sampled_from(
            [
                "valid",
                "valid",
                "valid",
                "wrong_types",
                "huge",
                "deep",
                "bad_utf8",
                "dup_keys",
                "not_object",
                "truncated",
            ]
        )
    )
    if kind == "wrong_types":
        return json.dumps(draw(wrong)).encode()
    data = json.dumps(draw(body)).encode()
    if kind == "huge":
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * draw(st.integers(100_000, 2_000_000))}]}
        return json.dumps(big).encode()
    if kind == "deep":
        depth = draw(st.integers(50, 5000))
        return b'{"model":"m","messages":[{"role":"user","content":"hi"}],"extra":' + b"[" * depth + b"]" * depth + b"}"
    if kind == "bad_utf8":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"])) + data[at:]
    if kind == "dup_keys":
        return data[:-1] + b', "messages": [], "messages": "dup"}' if data.endswith(b"}") else data
    if kind == "not_object":
        return json.dumps(draw(json_value)).encode()
    if kind == "truncated":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    return data


@pytest.fixture(scope="module", params=[1, 2], ids=["1worker", "2workers"])
def fuzz_proxy(fake_upstream, request):
    from tests.support import start_proxy

    proc = start_proxy(fake_upstream.url, None, {"TOOLQUAKE_MAX_BODY_BYTES": str(4 * 1024 * 1024)},
                       "--workers", str(request.param))
    yield proc
    proc.stop()


@pytest.mark.needs_corpus
@pytest.mark.needs_embeddings
def test_no_proxy_5xx_on_fuzzed_bodies_through_every_profile(fuzz_proxy):
    client = httpx.Client(timeout=60)
    seen = {"requests": 0, "statuses": {}}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(raw=raw_bodies(), profile=st.sampled_from(PROFILES), seed=st.integers(0, 2**32))
    def one(raw: bytes, profile: str, seed: int) -> None:
        r = client.post(
            f"{fuzz_proxy.url}/p/{profile}/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json", "x-toolquake-seed": str(seed)},
        )
        seen["requests"] += 1
        seen["statuses"][r.status_code] = seen["statuses"].get(r.status_code, 0) + 1
        assert r.status_code < 500, (profile, r.status_code, r.text[:500], raw[:300])
        if r.status_code >= 400:
            # every error the client sees is OpenAI-shaped, whoever produced it
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"]

    one()
    assert fuzz_proxy.popen.poll() is None, "the proxy process died"
    metrics = client.get(f"{fuzz_proxy.url}/metrics").text
    assert metric_value(metrics, "toolquake_in_flight_requests") == 0
    log = fuzz_proxy.output()
    assert "internal_error" not in log, log[-3000:]
    assert seen["requests"] == EXAMPLES
    assert seen["statuses"].get(200, 0) > EXAMPLES // 4  # most valid bodies got through to the upstream
