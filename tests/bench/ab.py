"""A/B of proxy configurations in one run: the same load, alternating rounds, one proxy per arm.

`python -m tests.bench.ab --arm aiohttp='upstream_client = "aiohttp"' --arm native='upstream_client = "native"'`
starts the fake upstream and one single-worker proxy per arm (each arm's lines go under `[server]`; scoring off,
or on as `toolquake serve` has it by default with `--scoring`), then runs alternating wrk rounds (asyncio client
without wrk) over the arms at each concurrency: passthrough, and streaming with `--stream` (the proxy benchmark's
request, three tools; `--no-tools` without them; `--body realistic`: a 500-character user message and two
tools; `--body tiny`: a bare "hi"). `--ref NAME=GITREF` adds an arm running the code of another commit (e.g.
`--ref before=origin/main~3`, with the default configuration's [server]): the commit is exported and
installed with `pip install --no-deps --target` into a temporary folder and served from there, so a
change is A/B'd against the code before it in the same run. It prints, per arm, the medians of req/s,
p50 and the proxy's CPU per request (its own /proc counters), and each arm's ratio to the first arm.
On a shared machine read the ratios: every arm saw the same load at the same time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.bench.proxy_overhead import BODIES, cpu_per_request, proc_tree, run_asyncio, run_wrk
from tests.support import ROOT, Proc, start_fake_upstream, start_process, start_proxy
from tests.support.ports import held_port


def install_ref(ref: str, into: Path) -> Path:
    """The package as `pip install .` lays it out, from commit `ref` of this repository, under `into`."""
    src, site = into / "src", into / "site"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True)
    return site


def start_ref_proxy(site: Path, upstream_url: str, config_text: str) -> Proc:
    """`toolquake serve` from the code installed in `site` (run there, so this checkout's code is not imported), on a
    port held until it binds it (an older commit's server may not say which port it got)."""
    cfg = Path(tempfile.mkstemp(prefix="toolquake-", suffix=".toml")[1])
    cfg.write_text(config_text)
    with held_port("127.0.0.1") as port:
        args = ["-m", "toolquake", "serve", "--upstream", f"{upstream_url}/v1", "--port", str(port), "--workers", "1",
                "--config", str(cfg)]
        return start_process(args, port, "/healthz", env={"PYTHONPATH": str(site)}, cwd=site)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", default=[], help="NAME=TOML lines for [server] (repeat)")
    ap.add_argument("--ref", action="append", default=[],
                    help="NAME=GITREF: an arm serving that commit's code, default [server] (repeat)")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--stream", action="store_true", help="also a streaming workload")
    ap.add_argument("--no-tools", action="store_true", help="the request without its tools (a text answer)")
    ap.add_argument("--body", choices=sorted(BODIES), default="bench", help="the request body (default: bench, the "
                    "proxy benchmark's)")
    ap.add_argument("--scoring", action="store_true", help="live scoring on in every arm, as `toolquake serve` has "
                    "it by default (content matching against the corpus when it is pulled)")
    args = ap.parse_args()
    if not args.arm and not args.ref:
        ap.error("give at least one --arm or --ref")
    scoring = "" if args.scoring else "[scoring]\nenabled = false\n"
    load = run_wrk if shutil.which("wrk") else run_asyncio
    fake = start_fake_upstream()
    procs = {}
    tmp = tempfile.TemporaryDirectory(prefix="toolquake-ab-")
    try:
        for spec in args.ref:
            name, _, ref = spec.partition("=")
            site = install_ref(ref, Path(tmp.name) / name)
            procs[name] = start_ref_proxy(site, fake.url, f"[server]\n{scoring}")
        for spec in args.arm:
            name, _, lines = spec.partition("=")
            procs[name] = start_proxy(fake.url, f"[server]\n{lines}\n{scoring}")
        for proc in procs.values():
            run_asyncio(proc.url, 4, 1.0)
        body = BODIES[args.body]
        body = {k: v for k, v in body.items() if k != "tools"} if args.no_tools else body
        workloads = {"passthrough": json.dumps(body).encode()}
        if args.stream:
            workloads["streaming"] = json.dumps({**body, "stream": True}).encode()
        for work, payload in workloads.items():
            for conns in [int(c) for c in args.concurrency.split(",")]:
                compare(procs, work, payload, conns, args.rounds, args.seconds, load)
    finally:
        for proc in procs.values():
            proc.stop()
        fake.stop()
        tmp.cleanup()


def alternating_rounds(procs: dict[str, Any], payload: bytes, conns: int, rounds_n: int, seconds: float,
                       load: Any) -> tuple[dict[str, list[dict]], dict[str, dict[str, float]]]:
    """`rounds_n` rounds over the arms in turn (every arm sees the same load at the same time): each arm's rounds
    (`cpu_per_request`'s figures) and their medians of req/s, p50 and CPU per request."""
    rounds: dict[str, list[dict]] = {n: [] for n in procs}
    for _ in range(rounds_n):
        for name, proc in procs.items():
            rounds[name].append(cpu_per_request(proc.url, proc_tree(proc.popen.pid), conns, seconds, load,
                                                payload=payload))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("rps", "p50_ms", "cpu_ms_per_request")}
           for n, rs in rounds.items()}
    return rounds, med


def compare(procs: dict[str, Any], work: str, payload: bytes, conns: int, rounds_n: int, seconds: float,
            load: Any) -> None:
    """Alternating rounds of `payload` at `conns` connections over the arms; a table of medians and each arm's
    ratio to the first arm."""
    first = next(iter(procs))
    rounds, med = alternating_rounds(procs, payload, conns, rounds_n, seconds, load)
    print(f"\n{work}, {conns} connections, medians of {rounds_n} alternating rounds of {seconds:g} s")
    print("| arm | req/s | p50 | CPU per request | vs " + first + " (req/s, CPU) | non-2xx |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, m in med.items():
        bad = sum(r["non2xx"] for r in rounds[n])
        rps, cpu = m["rps"] / med[first]["rps"], m["cpu_ms_per_request"] / med[first]["cpu_ms_per_request"]
        print(f"| {n} | {m['rps']:.0f} | {m['p50_ms']:.3f} ms | {m['cpu_ms_per_request']:.3f} ms | "
              f"{rps:.2f}×, {cpu:.2f}× | {bad} |")


if __name__ == "__main__":
    main()
