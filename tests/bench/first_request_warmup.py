"""The first perturbed `expanded` request of a fresh process with an empty cache (a new pod's emptyDir),
with warm-up off (the request builds the tool-pool index) and on (wait for /readyz, then the request).

    python -m tests.bench.first_request_warmup [--runs 2] [--modes off,on]

Needs the corpus and the embeddings extra. Each run: the fake upstream, `toolquake serve` with the packaged
profiles and TOOLQUAKE_CACHE an empty temporary directory (the corpus read in place via TOOLQUAKE_CORPUS),
one chat completion on BFCL's multiple_4 through /p/expanded. Prints one JSON line per run: seconds from
start to /readyz 200, and the first request's wall time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import httpx


def one_run(warm_up: bool) -> dict[str, object]:
    from tests.support import recorded, start_fake_upstream, start_proxy
    from toolquake.bfcl import corpus

    case = corpus.load_case("multiple_4")
    body = corpus.case_request(case, model="fake-model")
    with tempfile.TemporaryDirectory(prefix="toolquake-bench-cache-") as cache:
        env = {"TOOLQUAKE_CACHE": cache, "TOOLQUAKE_CORPUS": str(corpus.corpus_root()),
               "TOOLQUAKE_WARM_UP": "1" if warm_up else "0", "TOOLQUAKE_GENERATOR_URL": ""}
        fake = start_fake_upstream()
        t0 = time.perf_counter()
        proxy = start_proxy(fake.url, None, env)
        try:
            while httpx.get(f"{proxy.url}/readyz", timeout=30).status_code != 200:
                time.sleep(0.1)
            ready = time.perf_counter() - t0
            t1 = time.perf_counter()
            r = httpx.post(f"{proxy.url}/p/expanded/v1/chat/completions", json=body, timeout=900,
                           headers={"X-Test-Tag": "bench"})
            first = time.perf_counter() - t1
            sent = json.loads(recorded(fake, "bench")[0]["body"])
            assert r.status_code == 200 and '"tool_pool_built"' in proxy.output(), r.text
            return {"warm_up": warm_up, "ready_s": round(ready, 2), "first_request_s": round(first, 3),
                    "status": r.status_code, "tools_in": len(body["tools"]), "tools_sent": len(sent["tools"])}
        finally:
            proxy.stop()
            fake.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--modes", default="off,on")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        for _ in range(args.runs):
            print(json.dumps(one_run(mode == "on")), flush=True)


if __name__ == "__main__":
    main()
