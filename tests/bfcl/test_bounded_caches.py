"""Caches keyed by what clients send are bounded in bytes, not only in entries (issue #28, item 3)."""

from __future__ import annotations

import json

import msgspec
import pytest

from toolquake.bfcl.lru import ENTRY_OVERHEAD, ByteLRU, text_bytes


def test_byte_lru_evicts_the_least_recently_used_until_both_bounds_hold():
    cache: ByteLRU[str, str] = ByteLRU(max_bytes=3 * (100 + ENTRY_OVERHEAD), max_entries=10)
    for key in "abc":
        assert cache.put(key, key * 100, 100)
    assert cache.get("a") == "a" * 100  # a is now the most recent
    assert cache.put("d", "d", 100)
    assert "b" not in cache and {"a", "c", "d"} == {k for k in "abcd" if k in cache}
    assert cache.nbytes == 3 * (100 + ENTRY_OVERHEAD)
    assert not cache.put("huge", "x", 10_000) and "huge" not in cache and len(cache) == 3
    assert cache.put("a", "again", 10) and cache.nbytes == 2 * (100 + ENTRY_OVERHEAD) + 10 + ENTRY_OVERHEAD
    few: ByteLRU[int, int] = ByteLRU(max_bytes=10**9, max_entries=2)
    for i in range(5):
        few.put(i, i, 8)
    assert len(few) == 2 and few.get(4) == 4 and few.get(0) is None


def test_semantic_normal_forms_keep_no_long_model_strings():
    from toolquake.scorers import semantic

    long_text = "Miami, FL " * 100_000  # ~1 MB a model might write
    assert semantic.normalize(long_text).startswith("miami florida")
    assert long_text not in semantic._NORMAL
    for i in range(1300):
        semantic.normalize(f"{i} " + "word " * 800)  # 4 KB each, and a normal form as long: over the 8 MiB
    assert semantic._NORMAL.nbytes <= semantic._NORMAL.max_bytes
    assert semantic.normalize("Miami, FL") == semantic.normalize("miami florida")


def test_conformance_offered_tools_cache_stays_within_its_budget():
    from toolquake.proxy.server.conformance import arguments

    for i in range(40):  # distinct ~200 KiB toolkits, as a client could send with every request
        tools = [{"type": "function", "function": {"name": f"f{i}_{j}", "description": "d" * 2000,
                                                   "parameters": {"type": "object", "properties": {}}}}
                 for j in range(100)]
        offered = arguments.Offered.from_raw(msgspec.json.encode({"tools": tools}))
        assert f"f{i}_0" in offered.tools
        assert arguments._tools_held[0] <= arguments._TOOLS_BUDGET
        assert sum(4 * len(k) for k in arguments._TOOLS) <= arguments._TOOLS_BUDGET


def test_generator_disk_cache_stops_writing_at_its_byte_bound(tmp_path):
    from toolquake.perturbers.helpers.generator import DiskCache

    cache = DiskCache(tmp_path / "paraphrase", max_bytes=20_000)
    written = []
    for i in range(100):  # prompts from clients: each distinct one is a new file
        entry = {"original": f"prompt {i} " + "p" * 1000, "answer": "a"}
        key = cache.key("v1", "m", entry["original"])
        if cache.put(key, entry):
            written.append(key)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "paraphrase").rglob("*.json"))
    assert 0 < on_disk <= 20_000 and 10 <= len(written) < 100
    assert cache.get(written[0])["answer"] == "a"
    again = DiskCache(tmp_path / "paraphrase", max_bytes=20_000)  # another step of the same directory
    assert not again.put(again.key("v1", "m", "one more"), {"original": "x" * 1000, "answer": "b"})
    assert json.loads(next((tmp_path / "paraphrase").rglob("*.json")).read_text())["answer"] == "a"


@pytest.mark.needs_embeddings
def test_embedding_cache_is_bounded_in_bytes():
    from toolquake.bfcl.embeddings import Embedder

    embedder = Embedder(cache_bytes=16 * 1024)
    for i in range(2):
        embedder.embed([f"{i}-{j} " + "query words " * 80 for j in range(8)])  # ~1 KB texts, 1.5 KB vectors
    assert 0 < embedder._cache.nbytes <= 16 * 1024
    assert 0 < len(embedder._cache) < 16 and text_bytes("x" * 960) * len(embedder._cache) <= 16 * 1024
