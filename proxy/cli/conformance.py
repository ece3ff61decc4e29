"""`toolquake conformance --backend URL`: probe a model server's tool calling with a fixed set of requests and
say, rule by rule, what it gets right and wrong (docs/conformance.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "description": "IANA time zone"}},
        "required": ["timezone"]}
NOW = {"type": "object", "properties": {}}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string"},
    "when": {"type": "object", "properties": {"date": {"type": "string"}, "hour": {"type": "integer"}},
             "required": ["date", "hour"]},
    "attendees": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}},
                                             "required": ["name"]}}},
    "required": ["title", "when", "attendees"]}
TOOLS = {"get_weather": ("Get the current weather in a city.", WEATHER),
         "get_time": ("Get the current time in a time zone.", TIME),
         "server_time": ("The server's clock; takes no parameters.", NOW),
         "create_event": ("Create a calendar event with attendees.", EVENT)}
#: name → (user message, tools offered, tool_choice: "required" or the one tool to call, parallel_tool_calls)
PROBES: dict[str, tuple[str, list[str], str, bool]] = {
    "single": ("What is the weather in Paris?", ["get_weather", "get_time"], "required", False),
    "parallel": ("What is the weather in Paris, and what time is it in Asia/Tokyo? Call both tools.",
                 ["get_weather", "get_time"], "required", True),
    "parameterless": ("What time does the server say it is?", ["server_time", "get_weather"], "server_time", False),
    "nested": ("Create an event 'Standup' on 2025-01-02 at 9 with Ada and Linus.", ["create_event"], "create_event",
               False),
}


def requests(model: str, max_tokens: int, only: list[str] | None = None) -> list[tuple[str, str, bool, dict[str, Any]]]:
    """(probe, route, stream, body) for every probe (or those in `only`), route and stream setting."""
    out = []
    for name, (question, tools, choice, parallel) in PROBES.items():
        if only and name not in only:
            continue
        for route in ("chat_completions", "responses"):
            for stream in (False, True):
                if route == "chat_completions":
                    body: dict[str, Any] = {
                        "model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                        "tools": [{"type": "function", "function": {"name": t, "description": TOOLS[t][0],
                                                                    "parameters": TOOLS[t][1]}} for t in tools],
                        "tool_choice": choice if choice == "required" else {"type": "function",
                                                                            "function": {"name": choice}}}
                else:
                    body = {"model": model, "input": question, "max_output_tokens": max_tokens,
                            "tools": [{"type": "function", "name": t, "description": TOOLS[t][0],
                                       "parameters": TOOLS[t][1]} for t in tools],
                            "tool_choice": choice if choice == "required" else {"type": "function", "name": choice}}
                body.update(stream=stream, temperature=0, parallel_tool_calls=parallel)
                out.append((name, route, stream, body))
    return out


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def run(args: argparse.Namespace) -> int:
    import httpx

    from toolquake.proxy.server.conformance import RULES, Offered, check

    base = base_url(args.backend)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    for h in args.header:
        key, sep, value = h.partition(":")
        if not sep or not key.strip():
            print(f"toolquake: --header {h!r} is not NAME: VALUE", file=sys.stderr)
            return 2
        headers[key.strip()] = value.strip()
    results: list[tuple[str, str, bool, str, list[Any]]] = []
    with httpx.Client(timeout=args.timeout, headers=headers) as client:
        model = args.model
        if not model:
            try:
                model = client.get(base + "/models").json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                print(f"toolquake: {base}/models named no model; pass --model", file=sys.stderr)
                return 2
        for probe, route, stream, body in requests(model, args.max_tokens, args.probe):
            path = "/chat/completions" if route == "chat_completions" else "/responses"
            try:
                r = client.post(base + path, json=body)
            except httpx.HTTPError as exc:
                results.append((probe, route, stream, f"error: {type(exc).__name__}", []))
                continue
            if r.status_code != 200:
                results.append((probe, route, stream, f"HTTP {r.status_code}", []))
                continue
            try:
                answer: Any = r.content if stream else r.json()
            except ValueError:
                results.append((probe, route, stream, "answer is not JSON", []))
                continue
            found = check(route, stream, answer, Offered.from_request(body))
            results.append((probe, route, stream, "ok" if not found else f"{len(found)} violation(s)", found))
    print(table(base, model, results, RULES))
    if any(status.startswith(("error", "HTTP", "answer")) for *_, status, _ in results):
        return 2
    return 1 if any(found for *_, found in results) else 0


def table(base: str, model: str, results: list[tuple[str, str, bool, str, list[Any]]], rules: dict[str, str]) -> str:
    """The probe's report as Markdown: one row per request, then one per rule."""
    lines = [f"# Tool-call conformance of {base} (model {model})", "",
             "| probe | route | stream | result | rules broken |", "|---|---|---|---|---|"]
    for probe, route, stream, status, found in results:
        broken = ", ".join(sorted({v.rule for v in found})) or "–"
        lines.append(f"| {probe} | {route} | {'yes' if stream else 'no'} | {status} | {broken} |")
    answered = [r for r in results if r[3] == "ok" or r[4]]
    lines += ["", f"| rule | result ({len(answered)} answers checked) | where |", "|---|---|---|"]
    for rule in rules:
        where = sorted({f"{p}/{'responses' if r == 'responses' else 'chat'}/{'stream' if s else 'plain'}"
                        for p, r, s, _, found in results if any(v.rule == rule for v in found)})
        lines.append(f"| {rule} | {'FAIL (' + str(len(where)) + ')' if where else 'ok'} | {', '.join(where) or '–'} |")
    details = [f"- {p}/{r}/{'stream' if s else 'plain'}: {v.rule}: {v.detail}" for p, r, s, _, found in results
               for v in found]
    if details:
        lines += ["", "Violations:", *details]
    return "\n".join(lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "conformance", help="probe a model server's tool calling against the OpenAI format, rule by rule",
        description="Send a fixed set of tool-calling requests (single call, parallel calls, a parameterless tool, "
                    "nested arguments; chat completions and the Responses API; streamed and not) to a backend, check "
                    "every answer with the proxy's conformance checker, and print a table of the rules it keeps "
                    "and breaks (docs/conformance.md). Exit code 0: no violation; 1: violations; 2: a request "
                    "failed (unreachable, non-200, not JSON).")
    p.add_argument("--backend", required=True, metavar="URL",
                   help="the backend's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (/v1 is added when missing)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token (never printed)")
    p.add_argument("--header", action="append", default=[], metavar="NAME: VALUE",
                   help="an extra header for every request (repeatable), e.g. a gateway's routing header")
    p.add_argument("--probe", action="append", choices=list(PROBES), default=None,
                   help="run only this probe (repeatable; default: all four)")
    p.add_argument("--max-tokens", type=int, default=256, help="token limit per answer (default 256)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    p.set_defaults(func=run)
