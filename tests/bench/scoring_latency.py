"""Client latency with live scoring on vs off, side by side in one run.

    python -m tests.bench.scoring_latency [--seconds 5] [--rounds 3] [--conns 1,16] [--out bench-results]

Two proxies in front of one fake upstream: one started with `--no-scoring`, one scoring every
answer (a labeled BFCL case, `X-Toolquake-Case: multiple_0`, answered with its ground truth; the
verdict counted and a row written to a SQLite store), plus that proxy's shadow profile (every
request also sends a perturbed twin and compares the answers). Load with `wrk --latency` (else a
sequential/concurrent httpx loop). Rounds alternate the arms; medians are reported with the ratio to
"scoring off", then how many answers were scored and dropped. Needs the corpus (`toolquake corpus pull`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.bench.proxy_overhead import _ms  # wrk duration parsing
from tests.support import start_fake_upstream, start_proxy

CASE = "multiple_0"
CONFIG = """
[profiles.shadow-reversed]
mode = "shadow"
max_concurrent = 64
perturbers = [{ name = "tool_order", params = { mode = "reverse" } }]

[scoring]
store = "%s"
semantic = false
"""


def request_and_headers() -> tuple[bytes, dict[str, str]]:
    from toolquake.bfcl.convert import openai_name
    from toolquake.bfcl.corpus import case_request, load_case

    case = load_case(CASE)
    calls = [{"name": openai_name(name), "arguments": {p: alts[0] for p, alts in params.items() if alts[0] != ""}}
             for entry in case.ground_truth for name, params in entry.items()]
    body = case_request(case, model="fake-model")
    return json.dumps(body).encode(), {"Content-Type": "application/json", "X-Toolquake-Case": CASE,
                                       "X-Fake-Answer": json.dumps({"calls": calls})}


def run_wrk(url: str, payload: bytes, headers: dict[str, str], conns: int, seconds: float) -> dict:
    import re
    import subprocess

    script = Path(tempfile.mkstemp(suffix=".lua")[1])
    lines = ['wrk.method = "POST"'] + [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items()]
    lines.append(f"wrk.body = [==[{payload.decode()}]==]")
    script.write_text("\n".join(lines) + "\n")
    out = subprocess.run(["wrk", "-t", "1", "-c", str(conns), "-d", f"{max(1, round(seconds))}s", "--latency",
                          "-s", str(script), url], capture_output=True, text=True, check=True).stdout
    pct = {p: _ms(v) for p, v in re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.M)}
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50_ms": pct["50"], "p99_ms": pct["99"], "n": total,
            "non2xx": int(non2xx.group(1)) if non2xx else 0}


def run_httpx(url: str, payload: bytes, headers: dict[str, str], conns: int, seconds: float) -> dict:
    async def main() -> dict:
        lat: list[float] = []
        bad = 0
        end = time.perf_counter() + seconds
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=conns)) as client:
            async def worker() -> None:
                nonlocal bad
                while time.perf_counter() < end:
                    t0 = time.perf_counter()
                    r = await client.post(url, content=payload, headers=headers)
                    lat.append((time.perf_counter() - t0) * 1000)
                    bad += r.status_code != 200
            await asyncio.gather(*(worker() for _ in range(conns)))
        lat.sort()
        return {"rps": len(lat) / seconds, "p50_ms": lat[len(lat) // 2], "p99_ms": lat[int(len(lat) * 0.99)],
                "n": len(lat), "non2xx": bad}

    return asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), threads included."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(load, proc, url: str, payload: bytes, headers: dict[str, str], conns: int, seconds: float) -> dict:
    """One load run plus the proxy's CPU milliseconds per request (robust to other load on the machine)."""
    before = cpu_seconds(proc.popen.pid)
    result = load(url, payload, headers, conns, seconds)
    time.sleep(0.3)  # let the background scoring of the last requests finish
    result["cpu_ms_per_req"] = (cpu_seconds(proc.popen.pid) - before) * 1000 / max(1, result["n"])
    return result


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of one measurement (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported (default 3)")
    ap.add_argument("--conns", default="1,16", help="comma-separated concurrency levels (default 1,16)")
    ap.add_argument("--tool", choices=["auto", "wrk", "httpx"], default="auto", help="load generator")
    ap.add_argument("--out", default="bench-results", help="directory for the JSON and Markdown results")
    args = ap.parse_args()
    try:
        payload, headers = request_and_headers()
    except FileNotFoundError as exc:
        sys.exit(f"scoring_latency: {exc}")
    load = run_wrk if args.tool == "wrk" or (args.tool == "auto" and shutil.which("wrk")) else run_httpx
    tmp = Path(tempfile.mkdtemp(prefix="toolquake-bench-"))
    fake = start_fake_upstream()
    off = start_proxy(fake.url, CONFIG % (tmp / "unused.sqlite"), None, "--no-scoring")
    on = start_proxy(fake.url, CONFIG % (tmp / "results.sqlite"))
    arms = {"scoring off": (off, f"{off.url}/p/off/v1/chat/completions"),
            "scoring on": (on, f"{on.url}/p/off/v1/chat/completions"),
            "scoring on + shadow twin": (on, f"{on.url}/p/shadow-reversed/v1/chat/completions")}
    table: dict[str, dict[int, list[dict]]] = {a: {} for a in arms}
    try:
        for _, url in arms.values():  # warm up (and let the case index load)
            load(url, payload, headers, 1, 1.0)
        for conns in [int(c) for c in args.conns.split(",")]:
            for _ in range(args.rounds):
                for arm, (proc, url) in arms.items():
                    table[arm].setdefault(conns, []).append(
                        measure(load, proc, url, payload, headers, conns, args.seconds))
        time.sleep(1.0)
        scored = metric(on.url, "toolquake_scored_total")
        dropped = metric(on.url, "toolquake_scoring_dropped_total")
        twins = metric(on.url, "toolquake_consistency_total")
    finally:
        on.stop()
        off.stop()
        fake.stop()
    lines = [
        f"# Client latency with live scoring ({platform.node()}, {load.__name__}, {args.rounds} rounds × "
        f"{args.seconds:g} s, medians)",
        "",
        "| arm | conns | p50 ms | p99 ms | req/s | p50 / off | p99 / off | proxy CPU ms/req | CPU / off | non-2xx |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary: dict = {}
    for conns in table["scoring off"]:
        keys = ("p50_ms", "p99_ms", "rps", "cpu_ms_per_req")
        base = {k: statistics.median(r[k] for r in table["scoring off"][conns]) for k in keys}
        for arm in arms:
            med = {k: statistics.median(r[k] for r in table[arm][conns]) for k in keys}
            bad = sum(r["non2xx"] for r in table[arm][conns])
            summary.setdefault(arm, {})[conns] = {
                **med,
                "p50_ratio": med["p50_ms"] / base["p50_ms"],
                "p99_ratio": med["p99_ms"] / base["p99_ms"],
                "cpu_ratio": med["cpu_ms_per_req"] / base["cpu_ms_per_req"],
                "non2xx": bad,
            }
            lines.append(
                f"| {arm} | {conns} | {med['p50_ms']:.3f} | {med['p99_ms']:.3f} | {med['rps']:.0f} | "
                f"{med['p50_ms'] / base['p50_ms']:.2f} | {med['p99_ms'] / base['p99_ms']:.2f} | "
                f"{med['cpu_ms_per_req']:.3f} | {med['cpu_ms_per_req'] / base['cpu_ms_per_req']:.2f} | {bad} |"
            )
    lines += [
        "",
        f"Scored answers: {scored:.0f}; dropped (queue full): {dropped:.0f}; shadow twins compared: {twins:.0f}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scoring_latency.md").write_text(text)
    (out / "scoring_latency.json").write_text(
        json.dumps({"arms": summary, "scored": scored, "dropped": dropped, "twins": twins}, indent=2)
    )


if __name__ == "__main__":
    main()
