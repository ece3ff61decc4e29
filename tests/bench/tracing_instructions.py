"""Tracing's cost in instructions (valgrind's callgrind counts instructions, not time: the same count whatever
else the machine does, where CPU time moves by tens of µs from run to run), two ways:

- in process: tracing's calls for one passthrough request (tracing_overhead.floor_request), N requests after 300
  of warm-up, minus the same process making only the check the proxy makes of each answer with tracing off (that
  it is a JSON object; with tracing on, the span's read of the answer is that check): instructions per request;
- a whole proxy (lean path, profile `off`, scoring off) under callgrind, tracing off and on (every request
  sampled, exported to a sink that drops), and with `--ref-on NAME=GITREF` another commit's code with tracing on:
  one arm at a time, N requests at C connections after 600 of warm-up, the counters zeroed in between.

The answers' token counts differ from answer to answer, as a real backend's do (the backend: tests/fake_upstream.py
`--usage-varies`); `--fixed-usage`: all the same, as the passes before the sixth measured.

    python -m tests.bench.tracing_instructions [--requests 1500] [--connections 8] [--ref-on NAME=GITREF]
        [--in-process-only] [--fixed-usage]

Needs valgrind (Debian package valgrind). Slow: about a minute per arm and per in-process count.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.bench.ab import install_ref
from tests.bench.proxy_overhead import BODY
from tests.bench.tracing_overhead import OFF, floor_answers, floor_base, floor_request, on
from tests.support import ROOT, start_fake_upstream, start_process
from tests.support.ports import held_port

WARM_IN_PROCESS, WARM_PROXY = 300, 600


def _total(out: str) -> int:
    """The instructions a callgrind run counted (the last dump written to `out`.*, or `out` itself)."""
    dumps = sorted(glob.glob(out + ".*"), key=os.path.getmtime) or [out]
    return int(re.search(r"^summary: (\d+)", Path(dumps[-1]).read_text(), re.M).group(1))


def in_process(n: int, site: Path | None = None, fixed: bool = False) -> float:
    """Instructions per request of tracing's calls for a passthrough request, in a process of their own."""
    counts = []
    for requests in (-n, n):  # -n: n of the proxy's own check of the answer alone (`floor_base`)
        out = tempfile.mkstemp(prefix="toolquake-cg-", suffix=".out")[1]
        # another commit's code: run in its install (found first), this checkout's benchmark code after it
        env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}" if site else str(ROOT)}
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
                        "tests.bench.tracing_instructions", "--child", str(requests),
                        *(["--fixed-usage"] if fixed else [])], cwd=site or ROOT, env=env,
                       check=True, capture_output=True)
        counts.append(_total(out))
        os.remove(out)
    return (counts[1] - counts[0]) / n


def _child(n: int, fixed: bool) -> None:
    """`n` requests after the warm-up; `-n`: the warm-up, then `n` of the check the proxy makes with tracing off.
    Their answers' token counts differ from answer to answer, or not (`fixed`)."""
    one, queue = floor_request()
    ids = [f"{i:016x}" for i in range(WARM_IN_PROCESS + abs(n))]
    answers = floor_answers(len(ids), fixed)
    for rid, answer in zip(ids[:WARM_IN_PROCESS], answers):  # the caches warm, as in a running proxy
        one(rid, answer)
    queue.clear()
    if n < 0:
        check_object = floor_base()
        for answer in answers[WARM_IN_PROCESS:]:
            check_object(answer)
        return
    for rid, answer in zip(ids[WARM_IN_PROCESS:], answers[WARM_IN_PROCESS:]):
        one(rid, answer)


async def _send(url: str, n: int, connections: int) -> int:
    """`n` passthrough requests over `connections` kept-alive connections; how many were not answered 200."""
    bad = 0
    left = n
    body = json.dumps(BODY).encode()
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        async def worker() -> None:
            nonlocal left, bad
            while left > 0:
                left -= 1
                r = await client.post(url, content=body, headers={"content-type": "application/json",
                                                                 "authorization": "Bearer sk-test"})
                bad += r.status_code != 200
        await asyncio.gather(*[worker() for _ in range(connections)])
    return bad


def whole_proxy(name: str, config: str, upstream: str, n: int, connections: int, site: Path | None) -> float:
    """Instructions per request of a proxy under callgrind, `n` requests after the warm-up."""
    cfg = Path(tempfile.mkstemp(prefix="toolquake-", suffix=".toml")[1])
    cfg.write_text(config)
    out = tempfile.mkstemp(prefix=f"toolquake-cg-{name}-", suffix=".out")[1]
    env = {**os.environ, "PYTHONPATH": str(site or ROOT)}
    with held_port("127.0.0.1") as port:  # held until the proxy binds it (an older commit's may not say its port)
        proc = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                                 "-m", "toolquake", "serve", "--upstream", f"{upstream}/v1", "--port", str(port),
                                 "--workers", "1", "--config", str(cfg)], cwd=site or ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.terminate()
                raise RuntimeError(f"{name}: the proxy under valgrind did not start")
            time.sleep(1)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(_send(url, WARM_PROXY, connections))  # a slow first request may time out: not counted
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        bad = asyncio.run(_send(url, n, connections))
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        time.sleep(1)
        if bad:
            print(f"  ({name}: {bad} of {n} requests not answered 200)")
        return _total(out) / n
    finally:
        proc.terminate()
        proc.wait(60)
        for f in glob.glob(out + "*"):
            os.remove(f)
        cfg.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--ref-on", action="append", default=[], metavar="NAME=GITREF",
                    help="also that commit's code with tracing on (installed beside this checkout)")
    ap.add_argument("--in-process-only", action="store_true")
    ap.add_argument("--fixed-usage", action="store_true",
                    help="the answers all with the same token counts (the passes before the sixth measured so); by "
                         "default they differ from answer to answer, as a real backend's do")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        _child(args.child, args.fixed_usage)
        return
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("skipped: needs valgrind (Debian: apt-get install valgrind)")  # `make bench` runs on without it
        return
    tmp = tempfile.TemporaryDirectory(prefix="toolquake-cg-refs-")
    refs = {}
    for spec in args.ref_on:
        name, _, ref = spec.partition("=")
        refs[name] = install_ref(ref, Path(tmp.name) / name)
    usage = "the same token counts" if args.fixed_usage else "token counts that differ from answer to answer"
    print(f"in process, tracing's calls for one passthrough request ({args.requests} after {WARM_IN_PROCESS}; "
          f"answers with {usage}):")
    print(f"  this checkout: {in_process(args.requests, None, args.fixed_usage) / 1000:.1f}K instructions per request")
    for name, site in refs.items():
        print(f"  {name}: {in_process(args.requests, site, args.fixed_usage) / 1000:.1f}K instructions per request")
    if args.in_process_only:
        return
    fake = start_fake_upstream(*(() if args.fixed_usage else ("--usage-varies",)))
    with held_port("127.0.0.1") as port:  # the sink cannot say which port it got: held until it binds it
        sink = start_process(["-m", "tests.bench.otlp_sink", "--port", str(port)], port, "/_sink")
    try:
        arms = {"off": (OFF, None), "on": (on(sink.url), None)}
        arms.update({name: (on(sink.url), site) for name, site in refs.items()})
        print(f"\na whole proxy, {args.requests} passthrough requests at {args.connections} connections after "
              f"{WARM_PROXY}, one arm at a time:")
        per = {}
        for name, (config, site) in arms.items():
            per[name] = whole_proxy(name, config, fake.url, args.requests, args.connections, site)
            extra = "" if name == "off" else f" ({(per[name] - per['off']) / 1000:+.1f}K over off)"
            print(f"  {name}: {per[name] / 1000:.1f}K instructions per request{extra}", flush=True)
    finally:
        sink.stop()
        fake.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
