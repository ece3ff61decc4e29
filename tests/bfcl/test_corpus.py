"""The BFCL corpus: pulling it, loading every category, tools conversion, the content-hash index."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from toolquake.bfcl import corpus
from toolquake.bfcl.convert import from_openai_tools, to_openai_tools

ROOT = Path(__file__).resolve().parents[2]

# entry counts published in the BFCL v4 data specification (§1.1), agentic files counted per scored category
SPEC_COUNTS = {
    "simple_python": 400, "simple_java": 100, "simple_javascript": 50, "multiple": 200, "parallel": 200,
    "parallel_multiple": 200, "irrelevance": 240, "live_simple": 258, "live_multiple": 1053,
    "live_parallel": 16, "live_parallel_multiple": 24, "live_irrelevance": 884, "live_relevance": 16,
    "multi_turn_base": 200, "multi_turn_miss_func": 200, "multi_turn_miss_param": 200,
    "multi_turn_long_context": 200, "web_search_base": 100, "web_search_no_snippet": 100,
    "memory_kv": 155, "memory_vector": 155, "memory_rec_sum": 155,
}
# function docs per multi-turn API class (spec §1.1)
SPEC_CLASS_DOCS = {"GorillaFileSystem": 18, "MathAPI": 17, "MessageAPI": 10, "TwitterAPI": 14, "TicketAPI": 9,
                   "TradingBot": 20, "TravelAPI": 18, "VehicleControlAPI": 22, "WebSearchAPI": 2,
                   "MemoryAPI_kv": 15, "MemoryAPI_vector": 12, "MemoryAPI_rec_sum": 5}
OPENAI_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# what a BFCL type comes back as after BFCL's OpenAI conversion and our way back (lossy for these)
LOSSY = {"tuple": "array", "any": "string", "Any": "string", "String": "string", "Boolean": "string",
         "HashMap": "dict", "ArrayList": "array", "Array": "array", "long": "integer", "double": "number",
         "char": "string", "byte": "integer", "short": "integer", "list": "array", "object": "dict",
         "bool": "boolean", "Bigint": "integer"}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolquake", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120)


@pytest.mark.processes
def test_pull_reports_an_unreachable_index_clearly(tmp_path: Path) -> None:
    env = {"TOOLQUAKE_CACHE": str(tmp_path), "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": ""}
    done = run_cli("corpus", "pull", env=env)
    assert done.returncode == 1
    assert "pip could not download bfcl-eval==2026.3.23" in done.stderr
    assert "Traceback" not in done.stderr
    missing = run_cli("corpus", "path", env=env)
    assert missing.returncode == 1 and "toolquake corpus pull" in missing.stderr


@pytest.mark.processes
@pytest.mark.needs_corpus
def test_pull_extracts_from_the_cached_wheel_and_is_idempotent(tmp_path: Path) -> None:
    wheel = corpus.wheel_path()
    assert wheel is not None, "the corpus cache should keep the downloaded wheel"
    (tmp_path / "bfcl" / "wheels").mkdir(parents=True)
    shutil.copy(wheel, tmp_path / "bfcl" / "wheels" / wheel.name)
    # no index at all: the cached wheel must be enough
    env = {"TOOLQUAKE_CACHE": str(tmp_path), "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}
    first = run_cli("corpus", "pull", env=env)
    assert first.returncode == 0, first.stderr
    data = Path(first.stdout.strip())
    assert data == tmp_path / "bfcl" / corpus.CORPUS_VERSION
    assert (data / "BFCL_v4_simple_python.json").is_file()
    assert (data / "possible_answer" / "BFCL_v4_simple_python.json").is_file()
    assert (data / "multi_turn_func_doc" / "gorilla_file_system.json").is_file()
    stamp = (data / "BFCL_v4_multiple.json").stat().st_mtime_ns
    second = run_cli("corpus", "pull", env=env)
    assert second.returncode == 0 and "already present" in second.stderr
    assert (data / "BFCL_v4_multiple.json").stat().st_mtime_ns == stamp
    assert run_cli("corpus", "path", env=env).stdout.strip() == str(data)
    listed = run_cli("corpus", "list", "--json", env=env)
    assert json.loads(listed.stdout) == SPEC_COUNTS
    # the multi-turn simulators: the cached wheel installed --no-deps beside the data
    backends = run_cli("corpus", "pull", "--with-backends", env=env)
    assert backends.returncode == 0, backends.stderr
    installed = tmp_path / "bfcl" / f"backends-{corpus.CORPUS_VERSION}"
    assert (installed / "bfcl_eval" / "eval_checker" / "multi_turn_eval").is_dir()
    assert (installed / ".toolquake-complete").is_file()
    assert (data / "BFCL_v4_multiple.json").stat().st_mtime_ns == stamp


@pytest.mark.needs_corpus
def test_every_category_loads_with_the_published_counts() -> None:
    assert corpus.category_counts() == SPEC_COUNTS
    for name in corpus.CATEGORIES:
        for case in corpus.load_category(name):
            assert case.category == name == corpus.category_of(case.id)
            assert case.turns and all(isinstance(turn, list) for turn in case.turns)
            if name in corpus.RELEVANCE_CATEGORIES:
                assert case.ground_truth is None
            else:
                assert case.ground_truth, case.id
            if name in corpus.SINGLE_TURN_CATEGORIES:
                assert len(case.turns) == 1
            if name in corpus.MULTI_TURN_CATEGORIES:
                assert len(case.ground_truth) == len(case.turns)
                assert all(isinstance(call, str) for turn in case.ground_truth for call in turn)


@pytest.mark.needs_corpus
def test_multi_turn_docs_come_from_the_involved_classes() -> None:
    for name, n in SPEC_CLASS_DOCS.items():
        assert len(corpus.class_docs(name)) == n, name
    case = corpus.load_case("multi_turn_base_0")
    assert case.extra["involved_classes"] == ["TwitterAPI", "GorillaFileSystem"]
    assert len(case.functions) == 18 + 14
    assert case.ground_truth[0][0] == "cd(folder='document')"
    # miss_func: the held-out docs leave the tool list and wait for their turn
    held = corpus.load_case("multi_turn_miss_func_0")
    assert held.extra["missed_function_names"] == {"3": ["sort"]}
    assert [d["name"] for d in held.extra["missed_function"]["3"]] == ["sort"]
    assert "sort" not in {d["name"] for d in held.functions}
    assert held.turns[3] == []
    mem = corpus.load_case("memory_vector_0-customer-0")
    assert mem.extra["involved_classes"] == ["MemoryAPI_vector"] and len(mem.functions) == 12


@pytest.mark.needs_corpus
def test_load_case_finds_every_id_and_rejects_unknown_ones() -> None:
    for case in corpus.load_cases():
        assert corpus.load_case(case.id) is case
    for bad in ("simple_python_400", "nonsense", "no_such_category_1"):
        with pytest.raises(LookupError):
            corpus.load_case(bad)
    fs_id = "format_sensitivity_7:ret_fmt=json&tool_call_tag=True&func_doc_fmt=xml&prompt_fmt=plaintext" \
            "&style=classic:parallel_0"
    fs = corpus.load_case(fs_id)
    assert fs.id == fs_id and fs.extra["original_id"] == "parallel_0"
    assert fs.ground_truth == corpus.load_case("parallel_0").ground_truth
    assert sum(len(v) for v in corpus.format_sensitivity_ids().values()) == 200


def _walk_types(schema: dict[str, Any], out: list[str], depth: int = 0) -> None:
    if isinstance(schema.get("type"), str):
        out.append(schema["type"])
    for sub in (schema.get("properties") or {}).values():
        _walk_types(sub, out, depth + 1)
    if isinstance(schema.get("items"), dict):
        _walk_types(schema["items"], out, depth + 1)


def _project(schema: Any) -> Any:
    """The original doc with lossy types replaced by what survives the trip."""
    if isinstance(schema, dict):
        out = {k: _project(v) for k, v in schema.items()}
        if isinstance(out.get("type"), str):
            kept = out["type"] in {"string", "integer", "float", "boolean", "array", "dict"}
            out["type"] = out["type"] if kept else LOSSY.get(out["type"], "string")
        return out
    if isinstance(schema, list):
        return [_project(v) for v in schema]
    return schema


def _all_docs() -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for case in corpus.load_cases():
        for doc in case.functions:
            seen.setdefault(json.dumps(doc, sort_keys=True), doc)
    return list(seen.values())


@pytest.mark.needs_corpus
def test_tools_conversion_round_trips_on_every_corpus_function() -> None:
    docs = _all_docs()
    assert len(docs) > 1800
    exact = 0
    for doc in docs:
        tools, name_map = to_openai_tools([doc])
        fn = tools[0]["function"]
        assert tools[0]["type"] == "function" and OPENAI_NAME.match(fn["name"]), doc["name"]
        assert fn["parameters"]["type"] == "object"
        types: list[str] = []
        for sub in fn["parameters"]["properties"].values():
            _walk_types(sub, types)
        assert set(types) <= {"string", "integer", "number", "boolean", "array", "object"}, (doc["name"], types)
        assert name_map == {fn["name"]: doc["name"]}
        back = from_openai_tools(tools, name_map)[0]
        assert back == _project(doc), doc["name"]
        exact += back == doc
        # the conversion is stable: converting the way-back result again gives the same tools
        assert to_openai_tools([back])[0] == tools
    # most docs only use lossless types and come back identical
    assert exact > len(docs) * 0.8, (exact, len(docs))


@pytest.mark.needs_corpus
def test_case_request_is_a_chat_body_with_openai_tools() -> None:
    case = corpus.load_case("multiple_0")
    body = corpus.case_request(case, model="m")
    assert body["model"] == "m"
    assert body["messages"] == case.turns[0]
    assert body["messages"] is not case.turns[0]
    names = [t["function"]["name"] for t in body["tools"]]
    assert names == ["triangle_properties_get", "circle_properties_get"]
    radius = body["tools"][1]["function"]["parameters"]["properties"]["radius"]
    assert radius["type"] == "number" and radius["format"] == "float"
    assert case.functions[1]["parameters"]["properties"]["radius"]["type"] == "float"  # the case is untouched
    no_tools = next(c for c in corpus.load_category("live_irrelevance") if not c.functions)
    assert "tools" not in corpus.case_request(no_tools)


@pytest.mark.needs_corpus
def test_case_index_ties_a_reworded_whitespace_variant_to_its_case() -> None:
    index = corpus.CaseIndex.load(["simple_python", "multi_turn_base", "multi_turn_long_context"])
    case = corpus.load_case("simple_python_0")
    text = case.turns[0][0]["content"]
    messages = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "  " + text.upper().replace(" ", "\n  ") + " "}]
    assert index.lookup(messages) == ["simple_python_0"]
    assert index.lookup([{"role": "user", "content": [{"type": "text", "text": text}]}]) == ["simple_python_0"]
    assert index.lookup([{"role": "user", "content": "something no case asks"}]) == []
    # base and long_context share their first query: both ids come back
    shared = index.lookup(corpus.load_case("multi_turn_base_0").turns[0])
    assert "multi_turn_base_0" in shared and "multi_turn_long_context_0" in shared


def test_query_normalisation_splits_on_exactly_what_a_regex_whitespace_run_matches() -> None:
    r"""normalize_query collapses whitespace with str.split(); the index's keys must be those of `re.sub(r"\s+")`:
    the two agree on every code point, and so on every text."""
    space = re.compile(r"\s")
    assert [c for c in range(sys.maxunicode + 1) if (space.fullmatch(chr(c)) is not None) != chr(c).isspace()] == []


@given(st.text(alphabet=st.characters(codec="utf-8"))
       | st.text(alphabet=" \t\n\r\x0b\x0c\x1c\x85\xa0\u2028\u3000aB\u0130"))
def test_query_normalisation_is_the_regex_form(text: str) -> None:
    import unicodedata

    expected = re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()
    assert corpus.normalize_query(text) == expected


@pytest.mark.processes
@pytest.mark.needs_corpus
def test_perturb_dry_run_accepts_a_case_id(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text('[profiles.plain]\nperturbers = []\n')
    done = run_cli("perturb", "--config", str(cfg), "--profile", "plain", "--case", "parallel_multiple_3")
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    case = corpus.load_case("parallel_multiple_3")
    assert body["messages"] == case.turns[0]
    assert [t["function"]["name"] for t in body["tools"]] == [d["name"].replace(".", "_") for d in case.functions]
    unknown = run_cli("perturb", "--config", str(cfg), "--profile", "plain", "--case", "parallel_9999")
    assert unknown.returncode != 0 and "unknown case id" in unknown.stderr


@pytest.mark.needs_corpus
def test_case_request_shows_docs_as_bfcl_does_at_generation_time() -> None:
    java = corpus.load_case("simple_java_0")
    body = corpus.case_request(java)
    fn = body["tools"][0]["function"]
    assert fn["description"].endswith(" Note that the provided function is in Java 8 SDK syntax.")
    for name, schema in fn["parameters"]["properties"].items():
        original = java.functions[0]["parameters"]["properties"][name]["type"]
        assert schema["type"] == "string" and "items" not in schema
        assert f"Java {original} type" in schema["description"] or original == "any"
    py = corpus.case_request(corpus.load_case("simple_python_0"))["tools"][0]["function"]
    assert py["description"].endswith(" Note that the provided function is in Python 3 syntax.")
    raw = corpus.case_request(corpus.load_case("simple_python_0"), language_hints=False)["tools"][0]["function"]
    assert raw["description"] == corpus.load_case("simple_python_0").functions[0]["description"]
