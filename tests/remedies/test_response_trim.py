"""response_trim, in-process: the record the question needs kept, the rest in order, the note; linear time and
bounded memory on hostile 10 MB tool messages."""

from __future__ import annotations

import copy
import json
import random
import time
import tracemalloc
from typing import Any

import pytest

from toolquake.perturbers.base import ChatRequest, PerturbContext, Services
from toolquake.perturbers.helpers.tokens import EstimateCounter
from toolquake.remedies import build

CITIES = ["Paris", "Rome", "Oslo", "Lima", "Quito", "Hanoi"]


def conversation(content: str, question: str = "What is the temperature at Reykjavik harbour?") -> dict[str, Any]:
    return {"model": "m", "messages": [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "readings", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": content}]}


def run(body: dict[str, Any], budget: int) -> tuple[ChatRequest, ChatRequest, dict[str, Any]]:
    request = ChatRequest(body)
    ctx = PerturbContext(perturbation_seed=1, rng=random.Random(1), services=Services(token_counter=EstimateCounter()))
    return request, build("response_trim", {"budget_tokens": budget}).apply(request, ctx), ctx.report


def records(n: int, needle_at: int) -> list[dict[str, Any]]:
    out = [{"station": f"st-{i}", "city": CITIES[i % len(CITIES)], "temp_c": i % 31,
            "note": "routine reading, sensor nominal"} for i in range(n)]
    out[needle_at] = {"station": "st-harbour", "city": "Reykjavik harbour", "temp_c": -4, "note": "gusts"}
    return out


def test_a_json_response_keeps_the_needed_record_and_the_order_with_a_note():
    data = {"status": "ok", "readings": records(3000, 1777)}
    body = conversation(json.dumps(data))
    before = copy.deepcopy(body)
    _, out, report = run(body, 600)
    assert body == before  # the input is never changed
    content = out.messages[2]["content"]
    value, note = content.rsplit("\n", 1)
    kept = json.loads(value)
    assert kept["status"] == "ok"  # the JSON around the records is kept
    assert {"station": "st-harbour", "city": "Reykjavik harbour", "temp_c": -4, "note": "gusts"} in kept["readings"]
    order = [data["readings"].index(r) for r in kept["readings"]]
    assert order == sorted(order)
    dropped = 3000 - len(kept["readings"])
    assert note == f"[toolquake: {dropped} of 3000 records left out to fit 600 tokens]"
    assert report["trimmed"] == 1 and report["records_dropped"] == dropped
    assert report["tokens_after"] == EstimateCounter().count_text(content) <= 600 < report["tokens_before"]
    assert out.messages[:2] == body["messages"][:2]


def test_text_lines_keep_the_needed_line_in_order():
    lines = [f"{CITIES[i % 6]} reading {i}: nominal" for i in range(4000)]
    lines[2500] = "Reykjavik harbour reading: -4 C, gusts"
    _, out, report = run(conversation("\n".join(lines)), 300)
    kept, note = out.messages[2]["content"].rsplit("\n", 1)
    assert "Reykjavik harbour reading: -4 C, gusts" in kept.split("\n")
    order = [lines.index(line) for line in kept.split("\n")]
    assert order == sorted(order)
    assert note.startswith("[toolquake: ") and note.endswith(" of 4000 records left out to fit 300 tokens]")
    assert report["tokens_after"] <= 300


def test_the_budget_holds_by_a_tokenizers_count():
    """With a counter other than the estimate (OpenAI's o200k_base), the estimate's record costs are scaled by what
    the counter says of the whole, and the cut content counts within the budget by that counter."""
    import importlib.util

    from toolquake.bfcl.corpus import cache_root
    from toolquake.perturbers.helpers.tokens import make_counter

    if importlib.util.find_spec("tiktoken") is None:
        pytest.skip("needs the tokenizers extra (tiktoken)")
    if not (cache_root() / "tiktoken" / "o200k_base.tiktoken").is_file():
        pytest.skip("needs OpenAI's encoding files: make tiktoken-files")
    counter = make_counter("tiktoken:o200k_base")
    body = conversation(json.dumps({"status": "ok", "readings": records(3000, 1777)}))
    for budget in (300, 1000, 5000):
        ctx = PerturbContext(perturbation_seed=1, rng=random.Random(1), services=Services(token_counter=counter))
        out = build("response_trim", {"budget_tokens": budget}).apply(ChatRequest(body), ctx)
        content = out.messages[2]["content"]
        assert "Reykjavik harbour" in content
        assert ctx.report["tokens_after"] == counter.count_text(content) <= budget
        assert ctx.report["counter"] == "tiktoken:o200k_base"


def test_a_response_within_the_budget_is_left_as_it_came():
    request, out, report = run(conversation("short answer"), 600)
    assert out is request and report["trimmed"] == 0 and report["records_dropped"] == 0


def test_bad_budget_is_refused_at_load():
    with pytest.raises(ValueError, match="remedy 'response_trim': budget_tokens must be positive"):
        build("response_trim", {"budget_tokens": 0})


MB = 1 << 20
HOSTILE = {
    "tiny lines": lambda size: "ab 12\n" * (size // 6),
    "one line": lambda size: "word " * (size // 5),
    "brackets": lambda size: "[" * size,
    "json items": lambda size: "[" + ",".join(['{"a":1}'] * (size // 8)) + "]",
}


def _cpu(content: str) -> float:
    best = float("inf")
    for _ in range(2):
        t0 = time.process_time()
        run(conversation(content, "find the word ab 12"), 2000)
        best = min(best, time.process_time() - t0)
    return best


#: how much longer 4 times the content may take: 4 when linear, 16 when quadratic; wide for a loaded machine
GROWTH = 8.0


@pytest.mark.parametrize("shape", HOSTILE)
def test_time_is_linear_in_the_content(shape):
    make = HOSTILE[shape]
    small, large = make(MB // 4), make(MB)
    _cpu(small)  # warm up
    ratio = _cpu(large) / max(_cpu(small), 1e-3)
    assert ratio < GROWTH, f"{shape}: 4x the content took {ratio:.1f}x as long"


def test_memory_stays_a_few_times_a_hostile_message():
    """4 MB of 6-byte lines (700,000 of them: made into about 20,000 runs; a string per line would hold 45 MB more);
    4 MB rather than 10 because tracemalloc slows every allocation ten times over. Measured: 19 MB at 4 MB, 26 MB
    at 10 MB (what is not the content is about 12 MB, whatever its size)."""
    content = HOSTILE["tiny lines"](4 * MB)
    tracemalloc.start()
    try:
        _, out, report = run(conversation(content, "find ab 12"), 2000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report["trimmed"] == 1 and report["tokens_after"] <= 2000
    assert peak < 3 * len(content) + 16 * MB, f"peak {peak / MB:.0f} MB for {len(content) / MB:.0f} MB of content"
