"""Client-chosen case ids cannot grow the proxy (issue #28, item 3).

`X-Toolquake-Case` is checked against the corpus and the loaded user cases before anything is kept: an id
longer than every real one is refused unread, a format-sensitivity id must name a real index, one of BFCL's
26 configurations and a single-turn case, and what is cached is bounded in bytes. Unknown ids are served and
counted as `toolquake_scoring_skipped_total{reason="unknown_case"}`.
"""

from __future__ import annotations

import json
import tracemalloc
import uuid

import httpx
import pytest

from tests.support import scraped, wait_for
from tests.support.live import gt_calls, live_config, rss, send

HEADER_KIB = 512
FLOOD = 60
#: growth allowed for the whole flood (the old code kept each header, twice: about 61 MB for this flood)
RSS_BOUND = 15 * 1024 * 1024


def header_cap() -> str | None:
    """The [server] key capping the request head, when this version has one (issue #28 item 4)."""
    import msgspec

    from toolquake.proxy.server.config import ServerConfig

    names = {f.name for f in msgspec.structs.fields(ServerConfig)}
    return "max_header_bytes" if "max_header_bytes" in names else None


def hostile_id(n: int) -> str:
    """A format-sensitivity id whose middle is HEADER_KIB KiB of client text (each one distinct)."""
    middle = f"{n:06d}-{uuid.uuid4().hex}-" + "x" * (HEADER_KIB * 1024)
    return f"format_sensitivity_1:{middle}:simple_python_0"


@pytest.mark.needs_corpus
def test_distinct_huge_case_headers_do_not_grow_the_proxy_and_real_ids_still_score(request, proxy_factory, tmp_path):
    from toolquake.bfcl.corpus import FORMAT_CONFIGS, case_request, load_case

    cap = header_cap()
    if cap is not None:  # the default header cap (the session's proxy) refuses such headers outright (431) ...
        small = request.getfixturevalue("proxy")
        r = httpx.post(f"{small.url}/v1/chat/completions", json={"model": "m", "messages": []},
                       headers={"X-Toolquake-Case": hostile_id(0)})
        assert r.status_code == 431
    # ... so raise it: behind a larger cap, what the resolver keeps must still be bounded
    config = live_config(tmp_path / "live.sqlite", semantic=False)
    if cap is not None:
        config = config.replace("[server]\n", f"[server]\n{cap} = {2 * HEADER_KIB * 1024}\n", 1)
    proxy = proxy_factory(config)
    wait_for(lambda: scraped(proxy, "toolquake_corpus_cases") > 0, what="the case index")
    case = load_case("simple_python_0")
    body = case_request(case)
    answer = {"calls": gt_calls(case)}
    headers = {"X-Fake-Answer": json.dumps(answer)}

    def flood(start: int, count: int) -> list[int]:
        codes = []
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            for n in range(start, start + count):
                r = client.post("/v1/chat/completions", json={**body, "model": "fake-model"},
                                headers={**headers, "X-Toolquake-Case": hostile_id(n)})
                codes.append(r.status_code)
        return codes

    # warm up: the allocator's high-water mark for one such request is not growth
    warm = flood(0, 5)
    assert set(warm) == {200}, warm
    wait_for(lambda: scraped(proxy, "toolquake_scoring_skipped_total") >= len(warm), what="the warm-up to be counted")
    before = rss(proxy.popen.pid)
    codes = flood(100, FLOOD)
    after = rss(proxy.popen.pid)
    assert set(codes) == {200}, codes
    assert after - before < RSS_BOUND, f"RSS grew by {(after - before) / 2**20:.1f} MiB over {FLOOD} headers"
    served = len(codes) + len(warm)
    wait_for(lambda: scraped(proxy, "toolquake_scoring_skipped_total", reason="unknown_case") == served,
             what="every flooded request counted as unknown_case")
    assert scraped(proxy, "toolquake_scored_total") == 0

    # real ids still resolve: a BFCL id is scored; a format-sensitivity id of a real configuration names its case
    # (answered with native calls through `off`, it is counted as a category live scoring does not grade)
    for case_id in ("simple_python_0", f"format_sensitivity_5:{FORMAT_CONFIGS[5]}:simple_python_0"):
        _, message = send(proxy, "off", body, answer=answer, case_header=case_id, stream=False)
        assert message["tool_calls"]
    wait_for(lambda: scraped(proxy, "toolquake_scored_total") == 1, what="the BFCL id to be scored")
    assert scraped(proxy, "toolquake_scored_total", category="simple_python", verdict="valid") == 1
    wait_for(lambda: scraped(proxy, "toolquake_scoring_skipped_total", reason="unsupported_category") == 1,
             what="the format-sensitivity id to be resolved")
    assert scraped(proxy, "toolquake_scoring_skipped_total", reason="unknown_case") == served


@pytest.mark.needs_corpus
def test_the_resolver_keeps_nothing_of_ids_that_name_no_case():
    """In the process: the real resolver, given distinct large and malformed ids, allocates nothing that lasts."""
    from toolquake.bfcl import corpus
    from toolquake.perturbers import ChatRequest
    from toolquake.proxy.live.resolver import CaseResolver

    resolver = CaseResolver(match_content=False)
    request = ChatRequest({"messages": [{"role": "user", "content": "hi"}]})
    config = corpus.FORMAT_CONFIGS[0]
    assert resolver("simple_python_0", request).id == "simple_python_0"  # the category is loaded once
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(40):
            pad = f"{n}-" + "y" * (256 * 1024)
            for bad in (f"format_sensitivity_1:{pad}:simple_python_0",
                        f"format_sensitivity_1:{config}:simple_python_0{pad}",
                        f"simple_python_{pad}", f"  {pad}  "):
                assert resolver(bad, request) is None
        # short ids that name no case: a made-up configuration, a bad index, a multi-turn original, no entry
        for bad in ("format_sensitivity_1:ret_fmt=python:simple_python_0",
                    f"format_sensitivity_01:{config}:simple_python_0",
                    f"format_sensitivity_5200:{config}:simple_python_0",
                    f"format_sensitivity_1:{config}:multi_turn_base_0",
                    f"format_sensitivity_1:{config}:format_sensitivity_1:{config}:simple_python_0",
                    "simple_python_99999", "nonsense"):
            assert resolver(bad, request) is None, bad
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1024 * 1024, f"{grown} bytes kept after 160 ids of 256 KiB"
    fs = resolver(f"format_sensitivity_1:{config}:simple_python_0", request)
    assert fs.category == "format_sensitivity"
    assert (fs.extra["format_config"], fs.extra["original_id"]) == (config, "simple_python_0")
    assert len(fs.id) <= corpus.MAX_CASE_ID_LENGTH


@pytest.mark.needs_corpus
def test_many_valid_format_sensitivity_ids_stay_within_the_byte_bound():
    """Every (configuration, case) pair is a valid id: the cache of their cases holds at most its budget."""
    from toolquake.bfcl import corpus

    originals = [c.id for c in corpus.load_category("simple_python")]
    corpus.load_case(f"format_sensitivity_0:{corpus.FORMAT_CONFIGS[0]}:{originals[0]}")
    cache = corpus._FS_CASES
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, config in enumerate(corpus.FORMAT_CONFIGS):
            for original in originals:
                case = corpus.load_case(f"format_sensitivity_{i}:{config}:{original}")
                assert case.extra["original_id"] == original
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < cache.nbytes <= cache.max_bytes and len(cache) <= cache.max_entries
    assert len(cache) < len(corpus.FORMAT_CONFIGS) * len(originals)  # the bound evicted some
    assert grown < 1.5 * cache.max_bytes, f"{grown} bytes held by a cache of {cache.max_bytes}"


@pytest.mark.needs_corpus
def test_max_case_id_length_is_the_longest_real_id():
    from toolquake.bfcl import corpus

    longest_single = max((c.id for c in corpus.load_cases(corpus.SINGLE_TURN_CATEGORIES)), key=len)
    last_index = len(corpus.FORMAT_CONFIGS) * corpus.FORMAT_SENSITIVITY_ENTRIES - 1
    longest_fs = f"format_sensitivity_{last_index}:{max(corpus.FORMAT_CONFIGS, key=len)}:{longest_single}"
    assert corpus.load_case(longest_fs).id == longest_fs
    assert len(longest_fs) == corpus.MAX_CASE_ID_LENGTH
    assert all(len(c.id) <= corpus.MAX_CASE_ID_LENGTH for c in corpus.load_cases())
    assert sum(len(v) for v in corpus.format_sensitivity_ids().values()) == corpus.FORMAT_SENSITIVITY_ENTRIES


def test_the_corpus_knows_the_same_26_configurations_as_the_format_rewrite():
    from toolquake.bfcl.corpus import FORMAT_CONFIGS
    from toolquake.perturbers.helpers.callformats import CONFIGURATIONS

    assert [c.config_string for c in CONFIGURATIONS] == list(FORMAT_CONFIGS)

