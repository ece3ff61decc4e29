"""BFCL's multi-turn API simulators, run in a sandboxed worker process.

The simulators (GorillaFileSystem, MathAPI, MessageAPI, TwitterAPI, TicketAPI, TradingBot, TravelAPI,
VehicleControlAPI) are BFCL's own classes, imported from the `bfcl-eval` wheel installed `--no-deps`
into the corpus cache by `toolquake corpus pull --with-backends`. They are never imported into the
calling process: a worker process (started by `Backends`, `python -I`) imports them, then installs an
audit hook (`sys.addaudithook`) that refuses file opens, `os` file-system and process calls,
subprocesses, sockets, new imports, `exec`/`compile` and pickle globals. From then on the worker
only reads requests from its stdin and answers on its stdout.

Nothing is ever `eval`-ed. A call is a method name, positional arguments and keyword arguments:
ground-truth call strings (Python call syntax, positional arguments allowed) are parsed with a safe
AST walk (`parse_call`: literals only); model calls come as names and JSON arguments. The worker
dispatches by name to a public method of an involved instance, with plain-data arguments only, and
turns the outcome into the string BFCL would feed back (`str`, `json.dumps` for dicts, and
`"Error during execution: ..."` for failures, with BFCL's wording for unknown and forbidden names).

A *world* is one fresh set of instances (one per involved class, loaded from the case's
`initial_config`, with `long_context` when asked): the model's and the ground truth's are separate
worlds, as in BFCL, and worlds never share state.
"""

from __future__ import annotations

import ast
import io
import itertools
import json
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# involved class → its module inside the wheel (facts of bfcl-eval's layout)
_PREFIX = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
CLASS_MODULES = {
    "GorillaFileSystem": f"{_PREFIX}.gorilla_file_system",
    "MathAPI": f"{_PREFIX}.math_api",
    "MessageAPI": f"{_PREFIX}.message_api",
    "TwitterAPI": f"{_PREFIX}.posting_api",
    "TicketAPI": f"{_PREFIX}.ticket_api",
    "TradingBot": f"{_PREFIX}.trading_bot",
    "TravelAPI": f"{_PREFIX}.travel_booking",
    "VehicleControlAPI": f"{_PREFIX}.vehicle_control",
}
#: classes created without `_load_scenario` (BFCL's STATELESS_CLASSES)
STATELESS_CLASSES = frozenset({"MathAPI"})
#: names BFCL refuses to execute, whatever they refer to
FORBIDDEN_NAMES = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})
ERROR_PREFIX = "Error during execution: "
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MEMORY_MB = 4096
_MARKER = ".toolquake-complete"


class BackendsMissing(FileNotFoundError):
    """The simulators are not installed; the message says how to install them."""


class BackendError(RuntimeError):
    """The worker failed (crashed, timed out, or refused a request)."""


# ---------------------------------------------------------------------------------------------
# where the simulators are


def backends_root() -> Path:
    """The directory holding the `--no-deps` install of bfcl-eval (BackendsMissing when absent)."""
    from toolquake.bfcl.corpus import backends_dir

    root = backends_dir()
    if not (root / _MARKER).is_file() or not (root / "bfcl_eval").is_dir():
        raise BackendsMissing(
            f"BFCL's multi-turn API simulators are not installed in {root}: run "
            "`toolquake corpus pull --with-backends` (installs the cached bfcl-eval wheel --no-deps; "
            "the math API also needs mpmath: pip install 'toolquake[multiturn]')")
    return root


def ensure_installed() -> Path:
    """Install the simulators from the cached wheel when missing (no network once the wheel is cached)."""
    try:
        return backends_root()
    except BackendsMissing:
        from toolquake.bfcl.corpus import pull

        pull(with_backends=True)
        return backends_root()


# ---------------------------------------------------------------------------------------------
# calls


@dataclass(frozen=True)
class Call:
    """One call to dispatch: a method name, positional and keyword arguments (plain data only)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, call: dict[str, Any]) -> Call:
        """From the decoded shape `{"name": ..., "arguments": {...}}` (model calls: keywords only)."""
        return cls(str(call.get("name")), (), dict(call.get("arguments") or {}))

    def render(self) -> str:
        """Python call syntax (for logs and reports; never evaluated)."""
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


def _literal(node: ast.AST) -> Any:
    """A literal argument: `ast.literal_eval` walks the node (constants, containers, signed numbers) and
    evaluates nothing else."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"not a literal: {ast.unparse(node)[:80]!r} ({exc})") from None


def parse_call(text: str) -> Call:
    """`name(arg, key=value)` → Call, through a safe AST walk (literal arguments only; never evaluated)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"not a call: {exc.msg}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain call by name: {text[:80]!r}")
    args = []
    for a in node.args:
        if isinstance(a, ast.Starred):
            raise ValueError("'*' arguments are not allowed")
        args.append(_literal(a))
    kwargs = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("'**' arguments are not allowed")
        kwargs[kw.arg] = _literal(kw.value)
    return Call(node.func.id, tuple(args), kwargs)


# ---------------------------------------------------------------------------------------------
# the parent side: a worker process and the worlds inside it

_HEADER = struct.Struct(">I")
_MAX_FRAME = 1 << 30


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_frame(fd: int, payload: bytes) -> None:
    data = _HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_frame(fd: int, deadline: float | None) -> bytes:
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if size > _MAX_FRAME:
        raise BackendError(f"oversized frame ({size} bytes)")
    return _read_exact(fd, size, deadline)


class Backends:
    """A sandboxed worker holding simulator worlds. Thread-safe (one request at a time); restarts on demand.

    `extra_classes` ({ClassName: "module:attribute"}) adds classes importable by the worker (tests use
    it to prove the sandbox); `root` overrides the install directory of the simulators.
    """

    def __init__(self, *, root: Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 memory_mb: int | None = DEFAULT_MEMORY_MB, extra_classes: dict[str, str] | None = None):
        self.root = root
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.extra_classes = dict(extra_classes or {})
        self._proc: subprocess.Popen | None = None
        self._stderr: Any = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.generation = 0  # bumped at each (re)start: worlds of an older generation are gone

    # -- process --------------------------------------------------------------------------------

    def _start(self) -> None:
        root = self.root or backends_root()
        project = str(Path(sys.modules["toolquake"].__file__).resolve().parent.parent)
        # -I: isolated mode (no user site, no PYTHON* variables, no cwd on sys.path): only the project is added
        boot = (f"import sys; sys.path.insert(0, {project!r}); from toolquake.bfcl.simulators import _worker_main; "
                "sys.exit(_worker_main(sys.argv[1:]))")
        cmd = [sys.executable, "-I", "-c", boot, "--worker", "--root", str(root)]
        if self.memory_mb:
            cmd += ["--memory-mb", str(self.memory_mb)]
        for name, target in self.extra_classes.items():
            cmd += ["--extra", f"{name}={target}"]
        if self._stderr is not None:
            self._stderr.close()
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, cwd=tempfile.gettempdir(), close_fds=True)
        self.generation += 1
        hello = self._roundtrip(("ping",))
        if hello.get("sandboxed") is not True:
            raise BackendError("the backends worker did not confirm its sandbox")

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0)
            return self._stderr.read()[-2000:].decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def close(self) -> None:
        with self._lock:
            self._kill()
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None

    def __enter__(self) -> Backends:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _roundtrip(self, request: tuple[Any, ...]) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 — only plain data can be sent
            raise BackendError(f"the request cannot be sent to the worker: {type(exc).__name__}: {exc}") from None
        try:
            _write_frame(proc.stdin.fileno(), payload)
            raw = _read_frame(proc.stdout.fileno(), time.monotonic() + self.timeout_s)
        except TimeoutError:
            self._kill()
            raise BackendError(f"the backends worker did not answer within {self.timeout_s:.0f} s "
                               f"({request[0]}); it was stopped") from None
        except (EOFError, BrokenPipeError, OSError) as exc:
            tail = self._stderr_tail()
            self._kill()
            raise BackendError(f"the backends worker died ({type(exc).__name__}){': ' + tail if tail else ''}"
                               ) from None
        answer = json.loads(raw)
        if "error" in answer:
            raise BackendError(answer["error"])
        return answer

    def request(self, *request: Any, generation: int | None = None) -> dict[str, Any]:
        """Send one request (starting the worker if needed); with `generation`, only to that worker."""
        with self._lock:
            alive = self._proc is not None and self._proc.poll() is None
            if generation is not None and (not alive or generation != self.generation):
                raise BackendError("the backends worker was stopped or restarted: this world's state is gone")
            if not alive:
                self._kill()
                self._start()
            return self._roundtrip(request)

    # -- worlds ---------------------------------------------------------------------------------

    def world(self, classes: Sequence[str], initial_config: dict[str, Any] | None = None,
              long_context: bool = False) -> World:
        """Fresh instances of `classes`, loaded from `initial_config` (BFCL's `_load_scenario`)."""
        wid = f"w{next(self._ids)}"
        answer = self.request("new", wid, list(classes), initial_config or {}, bool(long_context))
        return World(self, wid, tuple(classes), self.generation, answer["methods"])

    def signatures(self, classes: Sequence[str]) -> dict[str, list[str]]:
        """{method name: parameter names in order} for the public methods of `classes`."""
        return self.request("signatures", list(classes))["signatures"]


class World:
    """One set of simulator instances inside the worker."""

    def __init__(self, backends: Backends, wid: str, classes: tuple[str, ...], generation: int,
                 methods: dict[str, str]):
        self.backends = backends
        self.id = wid
        self.classes = classes
        self.generation = generation
        self.methods = methods  # public method name → class name

    def execute(self, calls: Iterable[Call]) -> list[str]:
        """Run calls in order; one result string per call (BFCL's strings, errors included)."""
        batch = [(c.name, tuple(c.args), dict(c.kwargs)) for c in calls]
        if not batch:
            return []
        return self.backends.request("call", self.id, batch, generation=self.generation)["results"]

    def differences(self, ground_truth: World) -> list[dict[str, str]]:
        """BFCL's state check: public attributes of every ground-truth instance compared with `!=`."""
        if ground_truth.generation != self.generation:
            raise BackendError("the two worlds live in different workers")
        return self.backends.request("compare", self.id, ground_truth.id, generation=self.generation)["differences"]

    def state(self) -> dict[str, dict[str, str]]:
        """{class: {public attribute: repr (shortened)}} for reports."""
        return self.backends.request("state", self.id, generation=self.generation)["state"]

    def close(self) -> None:
        try:
            self.backends.request("drop", self.id, generation=self.generation)
        except BackendError:
            pass  # the worker is gone, and the world with it

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_shared: Backends | None = None
_shared_lock = threading.Lock()


def shared() -> Backends:
    """The process-wide worker (started on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            import atexit

            _shared = Backends()
            atexit.register(_shared.close)
        return _shared


# ---------------------------------------------------------------------------------------------
# the worker side (runs in its own process; keep it to the standard library)

_REFUSED_EVENTS = frozenset({
    "open", "exec", "compile", "import", "pickle.find_class", "marshal.loads", "code.__new__",
    "function.__new__", "builtins.input", "mmap.__new__", "sqlite3.connect", "ctypes.dlopen",
    "urllib.Request", "webbrowser.open", "glob.glob", "tempfile.mkstemp", "tempfile.mkdtemp",
    "pty.spawn", "sys.setprofile", "sys.settrace", "resource.setrlimit", "sys.addaudithook",
})
_REFUSED_PREFIXES = ("os.", "subprocess.", "_posixsubprocess.", "socket.", "shutil.", "ctypes.",
                     "fcntl.", "signal.", "ftplib.", "http.", "smtplib.", "imaplib.", "poplib.", "nntplib.",
                     "telnetlib.", "winreg.", "msvcrt.", "_winapi.")


class SandboxViolation(RuntimeError):
    pass


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _REFUSED_EVENTS or event.startswith(_REFUSED_PREFIXES):
        raise SandboxViolation(f"sandbox: {event} is not allowed here")


_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _plain(value: Any, depth: int = 0) -> bool:
    if depth > 64:
        return False
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # plain data only: no globals at all
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def _result_string(value: Any) -> str:
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except Exception:  # noqa: BLE001 — BFCL falls back to str() for what json cannot encode
            return str(value)
    return str(value)


class _Worker:
    def __init__(self, classes: dict[str, type]):
        self.classes = classes
        self.worlds: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

    def new(self, wid: str, names: list[str], config: dict[str, Any], long_context: bool) -> dict[str, Any]:
        import copy
        import inspect

        instances: dict[str, Any] = {}
        methods: dict[str, Any] = {}
        owners: dict[str, str] = {}
        for name in names:
            cls = self.classes.get(name)
            if cls is None and name in _UNAVAILABLE:
                raise LookupError(f"API class {name} is unavailable: {_UNAVAILABLE[name]}")
            if cls is None:
                raise LookupError(f"unknown API class {name!r} (known: {', '.join(sorted(self.classes))})")
            instance = cls()
            if name not in STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(config.get(name, {})), long_context=long_context)
            instances[name] = instance
            for mname, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not mname.startswith("_"):  # later classes win, as in BFCL
                    methods[mname] = method
                    owners[mname] = name
        self.worlds[wid] = (instances, methods)
        return {"methods": owners}

    def call(self, wid: str, batch: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> dict[str, Any]:
        _, methods = self.worlds[wid]
        return {"results": [self._one(methods, name, args, kwargs) for name, args, kwargs in batch]}

    @staticmethod
    def _one(methods: dict[str, Any], name: Any, args: Any, kwargs: Any) -> str:
        if not isinstance(name, str) or not name:
            return ERROR_PREFIX + "invalid function name"
        head = name.split("(", 1)[0]
        short = head.split(".")[1] if "." in head else head
        if short in FORBIDDEN_NAMES:  # BFCL's filter applies before anything else
            return f"{ERROR_PREFIX}Function call {short} is not allowed."
        method = methods.get(name)
        if method is None:
            return f"{ERROR_PREFIX}name '{name.split('.')[0]}' is not defined"
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            return ERROR_PREFIX + "malformed arguments"
        for key in kwargs:
            if not isinstance(key, str) or not key.isidentifier():
                return f"{ERROR_PREFIX}invalid keyword argument name {key!r}"
        if not _plain(args) or not _plain(kwargs):
            return ERROR_PREFIX + "arguments must be plain data"
        try:
            return _result_string(method(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 — every failure is reported as BFCL reports it
            return f"{ERROR_PREFIX}{exc}"

    def compare(self, model_wid: str, gt_wid: str) -> dict[str, Any]:
        model, _ = self.worlds[model_wid]
        truth, _ = self.worlds[gt_wid]
        diffs = []
        for cname, gt_instance in truth.items():
            instance = model[cname]
            for attr in vars(gt_instance):
                if attr.startswith("_"):
                    continue
                mine, theirs = getattr(instance, attr, None), getattr(gt_instance, attr)
                if mine != theirs:
                    diffs.append({"class": cname, "attribute": attr, "model": _short(mine),
                                  "ground_truth": _short(theirs)})
        return {"differences": diffs}

    def state(self, wid: str) -> dict[str, Any]:
        instances, _ = self.worlds[wid]
        return {"state": {c: {k: _short(v) for k, v in vars(i).items() if not k.startswith("_")}
                          for c, i in instances.items()}}

    def signatures(self, names: list[str]) -> dict[str, Any]:
        import inspect

        out: dict[str, list[str]] = {}
        for name in names:
            cls = self.classes[name]
            for mname, fn in inspect.getmembers(cls, predicate=inspect.isfunction):
                if not mname.startswith("_"):
                    out[mname] = [p for p in inspect.signature(fn).parameters if p != "self"]
        return {"signatures": out}

    def drop(self, wid: str) -> dict[str, Any]:
        self.worlds.pop(wid, None)
        return {}


def _short(value: Any, limit: int = 600) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001
        text = f"<unrepresentable: {type(exc).__name__}>"
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


_UNAVAILABLE: dict[str, str] = {}  # class → why it could not be imported (e.g. mpmath missing)


def _load_classes(root: str, extra: list[str]) -> dict[str, type]:
    import importlib

    sys.path.insert(0, root)
    classes: dict[str, type] = {}
    for name, module in CLASS_MODULES.items():
        try:
            classes[name] = getattr(importlib.import_module(module), name)
        except ImportError as exc:  # that class alone is unavailable
            _UNAVAILABLE[name] = f"{exc} (pip install 'toolquake[multiturn]')"
    for spec in extra:
        name, _, target = spec.partition("=")
        module, _, attr = target.partition(":")
        classes[name] = getattr(importlib.import_module(module), attr or name)
    return classes


def _warm_up(classes: dict[str, type]) -> None:
    """Exercise what lazily imports or opens files, before the audit hook forbids it."""
    import copy
    import datetime
    import decimal
    import inspect
    import random

    now = datetime.datetime.now()
    datetime.datetime.today()
    datetime.datetime.strptime("2024-01-02 03:04:05", "%Y-%m-%d %H:%M:%S")  # imports _strptime, locale, calendar
    now.strftime("%I:%M %p %Y-%m-%d %H:%M:%S")
    decimal.Decimal("1.5").quantize(decimal.Decimal("0.1"))
    random.Random(1).random()
    copy.deepcopy({"a": [1]})
    json.dumps({"a": 1})
    repr(1.5)
    for name, cls in classes.items():
        inspect.getmembers(cls, predicate=inspect.isfunction)
    if "MathAPI" in classes:
        import mpmath

        str(mpmath.log(mpmath.mpf(8), 2))


def _worker_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="toolquake-backends-worker")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--root", required=True)
    parser.add_argument("--memory-mb", type=int, default=0)
    parser.add_argument("--extra", action="append", default=[])
    args = parser.parse_args(argv)
    # the protocol owns the original stdout; anything the simulators print goes to stderr
    proto_in, proto_out = 0, os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.memory_mb:
        import resource

        limit = args.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    classes = _load_classes(args.root, args.extra)
    _warm_up(classes)
    worker = _Worker(classes)
    sys.addaudithook(_audit)
    while True:
        try:
            raw = _read_frame(proto_in, None)
        except EOFError:
            return 0
        try:
            request = _DataUnpickler(io.BytesIO(raw)).load()
            op, *rest = request
            if op == "ping":
                answer: dict[str, Any] = {"sandboxed": True, "classes": sorted(classes)}
            elif op in ("new", "call", "compare", "state", "signatures", "drop"):
                answer = getattr(worker, op)(*rest)
            else:
                answer = {"error": f"unknown operation {op!r}"}
            reply = json.dumps(answer).encode()
        except Exception as exc:  # noqa: BLE001 — reported to the parent, the worker keeps serving
            reply = json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000]}).encode()
        _write_frame(proto_out, reply)

