"""Request paths: which a client may send, and which are relayed to the backend (`[server] passthrough`).

**Refused on every route** (400 `invalid_path`, nothing sent upstream): a path that could name another resource
than the one it spells once a client, a proxy or the backend normalises or decodes it -- a dot segment (`.` or
`..`, spelled or percent-encoded), an encoded `/`, `?`, `#`, backslash or `%`, a backslash or a NUL. Checked
by `unsafe` on the path as the server decoded it and the request target's raw path (a few `in` tests; a
path with no `%` and no `/.` costs no more). `guarded` refuses them in front of the framework; the lean path
takes no path with a `%` (proxy/server/lean.py) and so leaves those to it.

**Relayed** (`Passlist`): under `/v1/...` (and `/p/{profile}/v1/...`) and at the backend's root, only the
paths `[server] passthrough` lists; any other gets the proxy's own 404 `not_found`, nothing sent. An entry is a
path (`/v1/models`: that path only) or a path ending in `/*` (`/v1/files/*`: every path below it). Matching a
path costs one set lookup per `/` in it. The upstream URL is built from the checked path, percent-encoded
again (`encoded`), never from the client's raw bytes.
"""

from __future__ import annotations

from typing import Any, Iterable
from urllib.parse import quote

from toolquake.proxy.server.errors import error_body

#: `[server] passthrough` by default: the OpenAI API's own resources (the model routes, POST
#: /v1/chat/completions and /v1/responses, are always served; their other methods are relayed), the backend's
#: tokenizer routes and llama.cpp's /extras/... A backend's own admin routes (vLLM's /v1/load_lora_adapter,
#: /sleep, /reset_prefix_cache, ...) and its other extras (/v1/rerank, /v1/score, /metrics, ...) are not listed.
DEFAULT_PASSTHROUGH = (
    "/v1/models", "/v1/models/*",
    "/v1/completions",
    "/v1/chat/completions", "/v1/chat/completions/*",
    "/v1/responses", "/v1/responses/*",
    "/v1/conversations", "/v1/conversations/*",
    "/v1/embeddings",
    "/v1/moderations",
    "/v1/audio/*",
    "/v1/images/*",
    "/v1/files", "/v1/files/*",
    "/v1/uploads", "/v1/uploads/*",
    "/v1/batches", "/v1/batches/*",
    "/v1/fine_tuning/*",
    "/v1/vector_stores", "/v1/vector_stores/*",
    "/v1/assistants", "/v1/assistants/*",
    "/v1/threads", "/v1/threads/*",
    "/v1/evals", "/v1/evals/*",
    "/v1/containers", "/v1/containers/*",
    "/v1/videos", "/v1/videos/*",
    "/tokenize", "/detokenize",
    "/extras/*",
)
#: an entry of `[server] passthrough` that stands for every entry of `DEFAULT_PASSTHROUGH`
DEFAULT_ENTRY = "default"
#: the first segments of the proxy's own routes: no passthrough entry may name a path under them
OWN_ROUTES = frozenset({"healthz", "readyz", "metrics", "admin", "p", "schema"})
#: what an entry may hold besides letters and digits (RFC 3986 pchar, without `%` escapes)
_ENTRY_CHARS = frozenset("/-._~!$&'()+,;=:@")
#: characters a path keeps as they are in the upstream URL (RFC 3986 pchar); everything else is escaped
_PATH_SAFE = "/:@!$&'()*+,;=-._~"
_DOT_SEGMENTS = ("/.", "/..")


def unsafe(raw: bytes | None, path: str) -> bool:
    """Whether a request path must be refused: `path` as the server decoded it, `raw` the request target's
    path as it came (None where the server does not give it: encoded slashes cannot be told then)."""
    if "/." in path and ("/./" in path or "/../" in path or path.endswith(_DOT_SEGMENTS)):
        return True
    if "\\" in path or "\x00" in path:
        return True
    if raw is not None and b"%" in raw:
        # what only an escape can put in the decoded path: ? and # (they end a path), % (a second layer of
        # escapes), and a / the raw path does not have
        return "?" in path or "#" in path or "%" in path or path.count("/") != raw.count(b"/")
    return False


INVALID_PATH_MESSAGE = ("The request path holds a dot segment ('.' or '..'), a backslash, a NUL, or an encoded "
                        "'/', '?', '#', '\\' or '%'; the proxy relays no such path. Spell the path plainly.")
_INVALID_PATH_BODY = error_body(INVALID_PATH_MESSAGE, "invalid_request_error", "invalid_path")
_INVALID_PATH_HEAD = {"type": "http.response.start", "status": 400,
                      "headers": [(b"content-type", b"application/json"),
                                  (b"content-length", str(len(_INVALID_PATH_BODY)).encode())]}


def guarded(app: Any, count: Any = None) -> Any:
    """An ASGI app that answers 400 `invalid_path` to an `unsafe` path and hands every other request to `app`;
    `count(reason)` (when given) is called once per refusal."""

    async def guard(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and unsafe(scope.get("raw_path"), scope["path"]):
            if count is not None:
                count("invalid_path")
            await send(_INVALID_PATH_HEAD)
            await send({"type": "http.response.body", "body": _INVALID_PATH_BODY, "more_body": False})
            return
        await app(scope, receive, send)

    return guard


def encoded(path: str) -> str:
    """A checked path (`unsafe` said no) as it goes in the upstream URL: every character outside RFC 3986's
    pchar escaped, so the backend decodes exactly `path`."""
    return quote(path, safe=_PATH_SAFE)


def check_entries(entries: Iterable[str]) -> list[str]:
    """`[server] passthrough`'s entries with `default` expanded; ValueError naming the first bad entry."""
    out: list[str] = []
    for entry in entries:
        if entry == DEFAULT_ENTRY:
            out.extend(DEFAULT_PASSTHROUGH)
            continue
        path = entry[:-2] if entry.endswith("/*") else entry
        segments = path.split("/")
        why = None
        if not path.startswith("/") or len(segments) < 2:
            why = "must start with '/' and name at least one segment (e.g. \"/v1/rerank\" or \"/extras/*\")"
        elif any(not s for s in segments[1:]) or any(s in (".", "..") for s in segments):
            why = "has an empty or dot segment"
        elif any(not (c.isascii() and c.isalnum()) and c not in _ENTRY_CHARS for c in path):
            why = "may hold only letters, digits and -._~!$&'()+,;=:@ between its slashes (no %, no * but a last /*)"
        elif segments[1] in OWN_ROUTES:
            why = f"is under the proxy's own /{segments[1]} route"
        elif path == "/v1":
            why = "names /v1 itself; list what under it may pass, or \"/v1/*\" for everything"
        if why is not None:
            raise ValueError(f"passthrough entry {entry!r} {why}")
        out.append(entry)
    return out


class Passlist:
    """The paths relayed to the backend (`[server] passthrough`, checked by `check_entries`)."""

    __slots__ = ("exact", "below")

    def __init__(self, entries: Iterable[str]) -> None:
        entries = check_entries(entries)
        self.exact = frozenset(e for e in entries if not e.endswith("/*"))
        #: the paths every path below which passes (the entries ending in /*, without it)
        self.below = frozenset(e[:-2] for e in entries if e.endswith("/*"))

    def allows(self, path: str) -> bool:
        """Whether the client path `path` (`/v1/...` or a root path, checked by `unsafe`) may be relayed."""
        if path in self.exact:
            return True
        below = self.below
        cut = path.rfind("/")
        while cut > 0:
            if path[:cut] in below:
                return True
            cut = path.rfind("/", 0, cut)
        return False

    def root_routes(self) -> tuple[list[str], list[str]]:
        """The framework routes the root entries need: the paths of one segment listed as they are (`/tokenize`),
        and the first segments with something listed below them (`extras` for `/extras/*`)."""
        whole, below = set(), set()
        for entry in (*self.exact, *(f"{b}/*" for b in self.below)):
            first, _, rest = entry[1:].partition("/")
            if first == "v1":
                continue
            if rest:
                below.add(first)
            else:
                whole.add(entry)
        return sorted(whole), sorted(below)
