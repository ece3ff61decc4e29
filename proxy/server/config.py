"""Configuration: a TOML file decoded into typed structs, then environment, then CLI flags.

Unknown keys and bad values are errors that name the offending key. Precedence: flags win over
environment (`TOOLQUAKE_*`), environment over the file, the file over the defaults.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from toolquake.proxy.server.paths import DEFAULT_PASSTHROUGH, check_entries

# the example profiles shipped in the package (proxy/profiles.toml)
PACKAGED_CONFIG = Path(__file__).resolve().parent.parent / "profiles.toml"


#: the `profile` label of the unperturbed (noise) twins' metrics: never a profile's name
NOISE_PROFILE = "<noise>"
#: the `profile` label of requests that reached no profile (passthrough, unknown profile): never a profile's name
NO_PROFILE = "-"
#: the longest profile name (it is a metric label value, a path segment and a header value)
MAX_PROFILE_NAME = 64
#: a profile's name: letters, digits, '.', '_' and '-', starting with a letter or digit (never NOISE_PROFILE, nor
#: the "-" label of requests with no profile)
_PROFILE_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_PROFILE_NAME - 1}}}")


class ConfigError(ValueError):
    """A configuration file, environment variable or admin payload that cannot be used."""


class PerturberSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    params: dict[str, Any] = {}
    probability: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be between 0 and 1, got {self.probability}")


class RemedySpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One remedy of a profile (`remedies = [{ name, params }]`), applied after every perturbation step."""

    name: str
    params: dict[str, Any] = {}


class ProfileSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    mode: Literal["perturb", "shadow", "off"] = "perturb"
    perturbers: list[PerturberSpec] = []
    #: steps applied after the perturbers, before the request goes upstream, to win accuracy back (remedies/)
    remedies: list[RemedySpec] = []
    description: str = ""
    #: shadow mode: fraction of requests that get a perturbed twin, and how many twins at once
    sample_rate: float = 1.0
    max_concurrent: int = 4
    #: shadow mode: fraction of requests that also get an unperturbed twin (the noise floor: how often the
    #: model disagrees with itself), counted under the profile label NOISE_PROFILE; 0 = none
    noise_rate: float = 0.0
    #: replay may ask for strict: a perturber failure fails the request instead of serving unperturbed
    strict: bool = False
    #: a call to a tool the proxy added (toolkit expansion, catalog padding): "answer" — the proxy tells the
    #: model the tool is unavailable and asks again, so the client only sees its own tools — or "pass"
    injected_calls: Literal["answer", "pass"] = "answer"
    #: turn a call the backend left in the answer's text (Hermes tags, Python-style list, JSON naming an offered
    #: tool) into proper tool_calls; a streamed answer is then read whole before it is sent (docs/conformance.md)
    repair: bool = False
    #: how replay plays a multi-turn case under this profile: "played" — the model plays every turn through the
    #: proxy (BFCL's loop, BFCL's whole-conversation verdict) — or "given" — the conversation up to the last user
    #: turn is the ground truth's (its calls and the simulators' results), one request asks for the next call,
    #: graded by BFCL's AST checker against the turn's first ground-truth call (seed 003 §3.3)
    conversation: Literal["played", "given"] = "played"

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be between 0 and 1, got {self.sample_rate}")
        if not 0.0 <= self.noise_rate <= 1.0:
            raise ValueError(f"noise_rate must be between 0 and 1, got {self.noise_rate}")
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    upstream: str = "http://127.0.0.1:8000/v1"
    host: str = "127.0.0.1"
    port: int = 8080
    default_profile: str = "off"
    #: request bodies larger than this are refused with 413
    max_body_bytes: int = 32 * 1024 * 1024
    #: bytes of one upstream answer the proxy keeps to read (check, assemble, restore); past it a relayed answer
    #: goes on uninspected (counted), and one the profile must read whole gets 502 `upstream_answer_too_large`
    max_answer_bytes: int = 32 * 1024 * 1024
    connect_timeout: float = 5.0
    #: seconds to wait for the upstream's answer (and between stream chunks) before 504
    read_timeout: float = 600.0
    max_connections: int = 2048
    #: "native" (default: own HTTP/1.1 client on httptools; https and HEAD go to aiohttp), "aiohttp" or
    #: "httpx": the HTTP client used for the upstream (docs/benchmarks.md compares them)
    upstream_client: Literal["native", "aiohttp", "httpx"] = "native"
    #: seconds an idle client connection is kept open; longer than clients' own idle timeouts, so a
    #: client never sends a request on a connection the proxy is closing
    keep_alive_timeout: float = 75.0
    #: seconds a client has to send a request's line and headers: from the connection's start, or from the first
    #: byte of a later request on a kept-alive connection; then 408 and the connection is closed
    header_timeout: float = 10.0
    #: seconds a client has to send a request's whole body, from the end of its headers (a total deadline: a body
    #: that stops or trickles is cut alike); then 408 and the connection is closed
    body_timeout: float = 30.0
    #: request line and headers larger than this (bytes) are refused with 431 and the connection closed
    max_header_bytes: int = 64 * 1024
    #: request URLs longer than this (bytes) are refused with 414 and the connection closed
    max_url_bytes: int = 8 * 1024
    #: client connections open at once, per worker; a connection beyond gets 503 (Retry-After) and is closed
    max_client_connections: int = 2048
    #: requests being served at once, per worker (streams included); a request beyond gets 503 (Retry-After);
    #: /healthz, /readyz and /metrics are never refused
    max_in_flight_requests: int = 1024
    #: profiles the proxy holds at once (the config file's and the admin API's; `off` not counted), for the whole
    #: proxy whatever its workers; an admin PUT adding one more gets 409 `too_many_profiles`
    max_profiles: int = 256
    #: set up every profile's perturbers (tool pool, embedding model, corpus filler) at start-up and when
    #: the admin API adds a profile, in the background; off: they load on first use
    warm_up: bool = False
    #: models that get their own `model` label in metrics; anything else is counted as "other"
    model_allowlist: list[str] = []
    #: "estimate" | "upstream" | "auto" (upstream when the backend can count, else estimate, loudly) |
    #: "tokenizer:/path/tokenizer.json"
    token_counter: str = "estimate"
    #: log message contents (debug only; never Authorization or keys)
    log_contents: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: check every answer relayed on a model route against the tool-call conformance rules (docs/conformance.md)
    conformance: bool = True
    #: extra modules to import at start-up; they register their own perturbers with @register
    plugins: list[str] = []
    #: serve requests that nothing perturbs or observes ahead of the framework (proxy/server/lean.py);
    #: false sends every request through the framework (kept for comparison, see docs/benchmarks.md)
    lean_path: bool = True
    #: serve the lean path inside uvicorn's HTTP protocol, before any ASGI (a plain answer in one write);
    #: false: as an ASGI app in front of the framework (kept for comparison, see docs/benchmarks.md)
    lean_protocol: bool = True
    #: worker processes sharing the port (`toolquake serve --workers`); 0 = one per CPU this process may use
    workers: int = 0
    #: the paths under /v1/ (and /p/<profile>/v1/) and at the backend's root that are relayed to the backend: a
    #: path, or a path ending in /* for every path below it; "default" stands for the default list (the OpenAI
    #: API's resources, /tokenize, /detokenize, /extras/*; docs/security.md). Any other path gets 404 `not_found`
    passthrough: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_PASSTHROUGH))

    def __post_init__(self) -> None:
        if not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http(s) URL, got {self.upstream!r}")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        if self.max_answer_bytes < 1:
            raise ValueError("max_answer_bytes must be positive")
        if self.workers < 0:
            raise ValueError("workers must be 0 (one per CPU) or more")
        if self.header_timeout <= 0 or self.keep_alive_timeout <= 0 or not self.body_timeout > 0:
            raise ValueError("header_timeout, body_timeout and keep_alive_timeout must be positive")
        if self.max_url_bytes < 1 or self.max_header_bytes < self.max_url_bytes:
            raise ValueError("max_url_bytes must be positive and max_header_bytes at least max_url_bytes")
        if self.max_client_connections < 1 or self.max_in_flight_requests < 1:
            raise ValueError("max_client_connections and max_in_flight_requests must be at least 1")
        check_entries(self.passthrough)
        if self.max_profiles < 1:
            raise ValueError("max_profiles must be at least 1")


class ScoringConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Live scoring (`[scoring]`): case resolution, the background queue, the results store."""

    enabled: bool = True
    #: where the BFCL corpus is: a toolquake cache dir or the data dir `toolquake corpus path` prints
    #: (default: the `toolquake corpus pull` cache)
    corpus: str = ""
    #: tie requests without X-Toolquake-Case to a case by their first user message (content hash)
    match_content: bool = True
    queue_size: int = 1024
    workers: int = 2
    #: also score in semantic mode and count the verdicts it flips (toolquake_semantic_flips_total)
    semantic: bool = True
    #: SQLite results file; "" = results.sqlite under the cache dir, "off" = no store
    store: str = ""
    #: keep request and answer bodies in the store (off by default)
    store_contents: bool = False
    #: files of your own cases (JSON lines, docs/own-cases.md), tied to requests by X-Toolquake-Case or content
    cases: list[str] = []

    def __post_init__(self) -> None:
        if self.queue_size < 1:
            raise ValueError("queue_size must be at least 1")
        if self.workers < 1:
            raise ValueError("workers must be at least 1")


_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "512MB", "1GiB"."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {value!r}: give bytes, or a number with B, KB, MB, GB, KiB, MiB or GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class RecordConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Recording (`[record]`): unperturbed exchanges appended to a JSON-lines file (proxy/live/recording.py)."""

    #: the recording file; "" = no recording (`toolquake serve --record PATH`)
    path: str = ""
    #: fraction of the recordable exchanges that are recorded
    sample_rate: float = 1.0
    #: profiles (names or shell patterns) whose exchanges are recorded; empty = every profile
    profiles: list[str] = []
    #: the file never grows past this (bytes, or "512MB", "1GiB"); then recording stops and drops are counted
    max_size: int | str = "1GiB"
    #: exchanges waiting to be written; when full, new ones are dropped and counted
    queue_size: int = 1024
    #: regular expressions whose matches in every string of a record are replaced by [redacted] (on top of the
    #: built-in secret shapes, proxy/live/redact.py)
    redact: list[str] = []
    #: CPU seconds the redaction of one text may take (a slow `redact` pattern); past it the text is replaced whole
    redact_timeout: float = 5.0
    #: fsync after each record (a power loss then loses at most the record being written)
    fsync: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be between 0 and 1, got {self.sample_rate}")
        if parse_size(self.max_size) < 1:
            raise ValueError("max_size must be positive")
        if self.queue_size < 1:
            raise ValueError("queue_size must be at least 1")
        if not self.redact_timeout > 0:
            raise ValueError(f"redact_timeout must be positive, got {self.redact_timeout}")
        import regex  # the engine the recorder matches with (it releases the GIL and takes a timeout)

        for pattern in self.redact:
            try:
                re.compile(pattern)
                regex.compile(pattern)
            except (re.error, regex.error) as exc:
                raise ValueError(f"redact pattern {pattern!r}: {exc}") from None


#: the OpenTelemetry SDK's own variables that `[tracing]` also takes as keys (the environment's value wins)
OTEL_KEYS = (
    "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_COMPRESSION", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG", "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_MAX_QUEUE_SIZE", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
)
#: `[tracing] max_queue_bytes`'s default: the encoded spans waiting for the collector (and, as much again, the
#: contents waiting to be redacted), per worker
TRACE_QUEUE_BYTES = 32 << 20
#: the characters a content attribute keeps (gen_ai.input.messages, ...) where OTEL_(SPAN_)ATTRIBUTE_VALUE_LENGTH_LIMIT
#: is not set
TRACE_CONTENT_CHARS = 64 << 10


class TracingConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """OpenTelemetry traces (`[tracing]`, docs/tracing.md): a GenAI span per proxied model request, exported over
    OTLP/HTTP in batches off the request path. The exporter, sampler and resource are set by the SDK's `OTEL_*`
    variables, or by the same names as keys of this table (`otel`, filled from them; the environment wins)."""

    enabled: bool = False
    #: prompt and answer contents in spans (gen_ai.input.messages, gen_ai.output.messages), redacted as the
    #: recording is (docs/own-cases.md); off: no content of a request or an answer is ever exported
    contents: bool = False
    #: bytes of encoded spans held for the collector (queued and being sent), per worker: past it a span is
    #: dropped and counted, as past OTEL_BSP_MAX_QUEUE_SIZE; the contents waiting to be redacted are bounded by as
    #: much again (past it a span goes without them). TOOLQUAKE_TRACING_MAX_QUEUE_BYTES
    max_queue_bytes: int = TRACE_QUEUE_BYTES
    #: OTEL_* keys given in the file (the names above)
    otel: dict[str, str] = {}

    def __post_init__(self) -> None:
        unknown = sorted(set(self.otel) - set(OTEL_KEYS))
        if unknown:
            raise ValueError(f"unknown OTEL_* key(s) {', '.join(unknown)}; known: {', '.join(OTEL_KEYS)}")
        if self.max_queue_bytes < 1 << 16:
            raise ValueError(f"max_queue_bytes must be at least 65536, got {self.max_queue_bytes}")
        limit = self.content_chars
        if limit < 64:
            raise ValueError(f"OTEL_(SPAN_)ATTRIBUTE_VALUE_LENGTH_LIMIT must be at least 64 characters, got {limit}")

    @property
    def content_chars(self) -> int:
        """The characters a content attribute keeps: OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT, else
        OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT (the SDK's order), else 65,536."""
        for key in ("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"):
            value = self.otel.get(key, "").strip()
            if value:
                try:
                    return int(value)
                except ValueError:
                    raise ValueError(f"{key}={value!r} is not a whole number of characters") from None
        return TRACE_CONTENT_CHARS


class Config(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    profiles: dict[str, ProfileSpec] = {}
    scoring: ScoringConfig = msgspec.field(default_factory=ScoringConfig)
    record: RecordConfig = msgspec.field(default_factory=RecordConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)


# environment variable -> (server field, type)
ENV_FIELDS: dict[str, tuple[str, type]] = {
    "TOOLQUAKE_UPSTREAM": ("upstream", str),
    "TOOLQUAKE_HOST": ("host", str),
    "TOOLQUAKE_PORT": ("port", int),
    "TOOLQUAKE_DEFAULT_PROFILE": ("default_profile", str),
    "TOOLQUAKE_MAX_BODY_BYTES": ("max_body_bytes", int),
    "TOOLQUAKE_MAX_ANSWER_BYTES": ("max_answer_bytes", int),
    "TOOLQUAKE_READ_TIMEOUT": ("read_timeout", float),
    "TOOLQUAKE_BODY_TIMEOUT": ("body_timeout", float),
    "TOOLQUAKE_TOKEN_COUNTER": ("token_counter", str),
    "TOOLQUAKE_LOG_CONTENTS": ("log_contents", bool),
    "TOOLQUAKE_LOG_LEVEL": ("log_level", str),
    "TOOLQUAKE_PLUGINS": ("plugins", list),
    "TOOLQUAKE_WARM_UP": ("warm_up", bool),
    "TOOLQUAKE_UPSTREAM_CLIENT": ("upstream_client", str),
    "TOOLQUAKE_WORKERS": ("workers", int),
    "TOOLQUAKE_PASSTHROUGH": ("passthrough", list),
    "TOOLQUAKE_MAX_PROFILES": ("max_profiles", int),
}


def _decode(raw: dict[str, Any], where: str) -> Config:
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_config(path: str | Path | None = None, *, env: dict[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """Read the file (the packaged example profiles when `path` is None), apply env and overrides."""
    env = os.environ if env is None else env
    source = Path(path) if path else PACKAGED_CONFIG
    try:
        raw = tomllib.loads(source.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {source}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    server = dict(raw.get("server") or {})
    for var, (key, kind) in ENV_FIELDS.items():
        if var in env and env[var] != "":
            value = env[var]
            try:
                if kind is bool:
                    server[key] = value.strip().lower() in ("1", "true", "yes", "on")
                elif kind is list:
                    server[key] = [v.strip() for v in value.split(",") if v.strip()]
                else:
                    server[key] = kind(value)
            except ValueError:
                raise ConfigError(f"{var}={value!r} is not a valid {kind.__name__}") from None
    for key, value in (overrides or {}).items():
        if value is not None:
            server[key] = value
    raw["server"] = server
    raw["tracing"] = _tracing(dict(raw.get("tracing") or {}), env)
    config = _decode(raw, str(source))
    load_plugins(config.server.plugins)
    validate_profiles(config.profiles)
    defined = len(set(config.profiles) - {"off"})
    if defined > config.server.max_profiles:
        raise ConfigError(f"{source}: {defined} profiles defined, more than [server] max_profiles = "
                          f"{config.server.max_profiles}")
    return config


def _tracing(table: dict[str, Any], env: Any) -> dict[str, Any]:
    """`[tracing]` with its OTEL_* keys gathered under `otel`, the environment over the file
    (TOOLQUAKE_TRACING, TOOLQUAKE_TRACING_CONTENTS, TOOLQUAKE_TRACING_MAX_QUEUE_BYTES, and the SDK's own OTEL_*
    variables)."""
    otel = {k: str(table.pop(k)) for k in list(table) if k.startswith("OTEL_")}
    otel.update({k: env[k] for k in OTEL_KEYS if env.get(k)})
    for var, key in (("TOOLQUAKE_TRACING", "enabled"), ("TOOLQUAKE_TRACING_CONTENTS", "contents")):
        if env.get(var):
            table[key] = env[var].strip().lower() in ("1", "true", "yes", "on")
    if env.get("TOOLQUAKE_TRACING_MAX_QUEUE_BYTES"):
        value = env["TOOLQUAKE_TRACING_MAX_QUEUE_BYTES"]
        try:
            table["max_queue_bytes"] = int(value)
        except ValueError:
            raise ConfigError(f"TOOLQUAKE_TRACING_MAX_QUEUE_BYTES={value!r} is not a valid int") from None
    if otel:
        table["otel"] = otel
    return table


def load_plugins(modules: list[str]) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"plugin module {name!r} cannot be imported: {exc}") from None


def decode_profile(payload: bytes | dict[str, Any], name: str) -> ProfileSpec:
    """Decode one profile (admin API or file) and check that its perturbers and remedies can be built."""
    try:
        if isinstance(payload, (bytes, bytearray)):
            spec = msgspec.json.decode(payload, type=ProfileSpec)
        else:
            spec = msgspec.convert(payload, ProfileSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"profile {name!r}: {exc}") from None
    validate_profiles({name: spec})
    return spec


def shown_name(name: str) -> str:
    """A profile name as an error message shows it: quoted, cut past MAX_PROFILE_NAME characters (a client's
    name can be as long as a URL or a header)."""
    return repr(name) if len(name) <= MAX_PROFILE_NAME else repr(name[:MAX_PROFILE_NAME]) + "..."


def validate_profiles(profiles: dict[str, ProfileSpec]) -> None:
    from toolquake import remedies
    from toolquake.perturbers import build

    for name, spec in profiles.items():
        if not _PROFILE_NAME.fullmatch(name):
            raise ConfigError(f"invalid profile name {shown_name(name)}: 1 to {MAX_PROFILE_NAME} letters, digits, "
                              "'.', '_' or '-', starting with a letter or digit")
        if name == "off" and (spec.perturbers or spec.remedies):
            raise ConfigError("profile 'off' is reserved and has no perturbers or remedies")
        for i, p in enumerate(spec.perturbers):
            try:
                build(p.name, p.params)
            except ValueError as exc:
                raise ConfigError(f"profile {name!r}, perturbers[{i}]: {exc}") from None
        for i, r in enumerate(spec.remedies):
            try:
                remedies.build(r.name, r.params)
            except ValueError as exc:
                raise ConfigError(f"profile {name!r}, remedies[{i}]: {exc}") from None
