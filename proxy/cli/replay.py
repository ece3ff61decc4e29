"""`toolquake replay`: BFCL cases and your own (`--cases`) × profiles through the proxy, verdicts in DIR
(see proxy/replay/run.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def temperature(text: str) -> float | None:
    """--temperature: a number, or `none` (a negative number too) to send no temperature, as BFCL does for models
    that take only their default (OpenAI's reasoning models refuse `temperature = 0`)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None
    return None if value < 0 else value


def _categories(text: str | None, cases: list[str] | None, profiles: str = "") -> list[str]:
    """--categories as given; without it, `multiple` (or the papers' categories of the presets asked for, when
    every --profiles item is such a preset: simple_python, live_simple and multiple for `@seed003`,
    format_sensitivity for `@seed002`, multi_turn_base for `@seed003-responses`) — or no BFCL category at all
    when --cases is given."""
    if text is None:
        from toolquake.proxy.replay.selection import default_categories

        return [] if cases else (default_categories(profiles) or ["multiple"])
    return [c.strip() for c in text.split(",") if c.strip()]


def run(args: argparse.Namespace) -> int:
    from toolquake.proxy.replay.errors import ReplayError
    from toolquake.proxy.replay.run import Options, iter_tallies, run
    from toolquake.proxy.replay.selection import parse_shard
    from toolquake.proxy.server import logs

    logs.configure("warning")
    try:
        options = Options(
            backend=args.backend, profiles=args.profiles, out=Path(args.out), config=args.config,
            categories=_categories(args.categories, args.cases, args.profiles), cases=list(args.cases or []),
            limit=args.limit,
            concurrency=args.concurrency, model=args.model, shard=parse_shard(args.shard), proxy=args.proxy,
            timeout=args.timeout, temperature=args.temperature, trials=args.trials,
            max_tokens=args.max_tokens, api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
            headers=dict(args.header or []), semantic=args.semantic, fail_open=args.fail_open,
            progress=not args.no_progress, token_counter=args.token_counter, allow_estimate=args.allow_estimate,
            self_rephrase=args.self_rephrase)
        summary = run(options)
    except ReplayError as exc:
        print(f"toolquake: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("toolquake: interrupted; finished pairs are saved, rerun the same command to resume.", file=sys.stderr)
        return 130
    width = max(len(a) for a in summary.arms)
    print(f"{'profile':<{width}}  {'n':>5}  accuracy")
    for arm, n, valid in iter_tallies(summary):
        print(f"{arm:<{width}}  {n:>5}  {valid / n:.3f}" if n else f"{arm:<{width}}  {n:>5}  -")
    print(f"results: {summary.path} (sent {summary.sent}, failed {summary.failed}, already scored "
          f"{summary.skipped}); `toolquake report {summary.path.parent}` for the tables", file=sys.stderr)
    if summary.model_failures:
        print(f"toolquake: {summary.model_failures} request(s) failed on the backend's side (refused, timed out "
              "after retries or unreadable): scored as wrong answers, as BFCL scores an inference error; "
              "`toolquake report` gives their codes", file=sys.stderr)
    if summary.not_comparable:
        print(f"toolquake: {summary.not_comparable} request(s) refused by the backend for their shape (too many "
              "tools, a parameter or schema it does not accept): not comparable, left out of every number; "
              "`toolquake report` gives their codes", file=sys.stderr)
    if summary.aborted:
        print(f"toolquake: {summary.aborted}", file=sys.stderr)
        return 3
    return 1 if summary.failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="replay BFCL cases and your own through the proxy, one arm per profile",
        description="Send every (case, profile) pair through the proxy (started in this process, or --proxy) "
                    "with the X-Toolquake-Case header, grade the answers with the BFCL-compatible scorer and "
                    "record them in a SQLite file in --out. Rerunning the same command resumes: scored pairs are "
                    "skipped, failed ones are retried; a killed run loses nothing that was recorded. A request the "
                    "backend refuses (e.g. 400 context_length_exceeded), that times out or gets a 500 three times, "
                    "or whose answer is unreadable is scored as a wrong answer, as BFCL scores an inference error; "
                    "a failure of the proxy, the network or access (502, 503, 429, 401) is retried on the next run "
                    "instead. Exit status: 0 all pairs scored, 1 some pairs failed on the proxy's or network's side "
                    "(recorded; rerun to retry), 2 bad "
                    "arguments or unreachable backend, 3 stopped because the backend went away.")
    p.add_argument("--profiles", required=True,
                   help="comma-separated profiles, one arm each: names from the config ('off' always exists), "
                        "shell patterns ('pad-*'), or presets '@seed001' (off, rephrased, expanded; multiple unless "
                        "--categories; the rephrased arm needs a fixed rephraser or --self-rephrase), '@seed003' "
                        "(off, pad-*: budgets × positions; simple_python, live_simple and multiple unless "
                        "--categories), '@seed003-prompt' (off, prompt-off, prompt-pad-*: the same grid in BFCL's "
                        "prompting mode, the padded catalog in the system prompt and BFCL's decoder, for models "
                        "without native tools and APIs that cap the tools array; report with --baseline prompt-off), "
                        "'@seed003-responses' (off, resp-*: the last tool response grown with real records to "
                        "10K-80K tokens and, at 80K, the originals after (p-1)/7 of the padding records, p = 1-8; "
                        "multi_turn_base unless --categories), '@seed002' (fmt-*: the 26 format configurations; "
                        "format_sensitivity unless --categories), '@seed003-conversations' (conv-off, conv-*: each "
                        "conversation given up to its last user turn, lengthened to 10K-80K tokens after the fact "
                        "in a user turn / a tool response, its next call graded by AST; multi_turn_base unless "
                        "--categories), '@seed003-conversations-bfcl' (off, bfcl-conv-*: the same, played live, "
                        "BFCL's whole-conversation verdict), '@remedies' (off, pad-{8k,32k,120k}-p50 each beside "
                        "its twin search-pad-*: tool_search k=8 after the padding; simple_python, live_simple and "
                        "multiple unless --categories), '@remedies-responses' (off, resp-{20k,80k}-p1 each beside "
                        "trim-resp-*: response_trim to 4,000 tokens; multi_turn_base unless --categories; the report's "
                        "remedies section pairs each remedied arm with its twin), '@tool_order', '@tool_removal'. "
                        "Several presets together replay the union of their categories")
    what_to_send(p)
    how_to_send(p)
    p.add_argument("--self-rephrase", action="store_true",
                   help="let arms with `paraphrase` (@seed001's rephrased) be rephrased, and arms with "
                        "`toolkit_expansion` generating its tools (source = generate) have them written, by the model "
                        "under test when no fixed generator model is configured (refused without it: seed 001 used "
                        "one fixed model, so every model saw the same text; set TOOLQUAKE_GENERATOR_URL and "
                        "TOOLQUAKE_GENERATOR_MODEL instead); the report labels the rephraser of each arm")
    p.add_argument("--trials", type=int, default=1, metavar="K",
                   help="send every (case, profile) K times (default 1), trial t with the sampling seed "
                        "trial_sampling_seed(case, t) — the same in every arm and on a rerun; each (case, profile, "
                        "trial) is recorded exactly once. The report adds the mean accuracy over trials with its "
                        "spread, pass^k and pass@k. Use with --temperature > 0")
    p.set_defaults(func=run)


def what_to_send(p: argparse.ArgumentParser, results: str = "replay") -> None:
    """Where to send, which cases, where the results go (replay's options, shared by `toolquake sweep`)."""
    p.add_argument("--backend", help="the model server's OpenAI API base URL, e.g. http://127.0.0.1:8000/v1 "
                   "(checked before starting; also where the model name comes from)")
    p.add_argument("--out", required=True, help=f"directory for the results file ({results}.sqlite, or "
                   f"{results}-shard-I-of-N.sqlite with --shard); reuse it to resume")
    p.add_argument("--config", help="TOML config with the profiles (env TOOLQUAKE_CONFIG; default: the packaged "
                   "profiles)")
    p.add_argument("--categories", default=None,
                   help="comma-separated BFCL categories: single-turn ones, or multi-turn ones (multi_turn_base, "
                        "multi_turn_miss_func, multi_turn_miss_param, multi_turn_long_context: whole conversations "
                        "against the API simulators, see docs/multiturn.md), or format_sensitivity (BFCL V4's "
                        "200-case format-sensitivity selection, for @seed002) (default: the papers' categories when "
                        "--profiles is only presets (see --profiles), else multiple; none when --cases is given)")
    p.add_argument("--cases", action="append", metavar="FILE",
                   help="a file of your own cases (JSON lines, docs/own-cases.md), repeatable; alone or with "
                        "--categories. Each case is reported under its `category` (default: the file's stem); "
                        "bad lines are reported and skipped (`toolquake cases validate FILE`)")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N cases of each BFCL category (file order; --cases files are replayed whole)")


def how_to_send(p: argparse.ArgumentParser) -> None:
    """How each request is sent and graded (shared by `toolquake sweep`)."""
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    p.add_argument("--model", help="model name to send (default: the first model the backend lists)")
    p.add_argument("--shard", help="I/N: only cases whose position in the selection is I modulo N (0-based); "
                   "N alone takes I from JOB_COMPLETION_INDEX (Kubernetes Indexed Job)")
    p.add_argument("--proxy", help="use a running proxy at this root URL (e.g. http://127.0.0.1:8080) instead of "
                   "one in this process; it must know the profiles")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one answer (default 600)")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="sampling temperature sent with each request (default 0); 'none' (or a negative number) "
                        "sends none, as BFCL does for models that take only their default temperature (OpenAI's "
                        "reasoning models refuse 0 with a 400: those pairs would be reported not comparable). The "
                        "report says what was sent")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens sent with each request (default: none)")
    p.add_argument("--api-key", help="bearer token for the backend (default: env OPENAI_API_KEY; never logged)")
    p.add_argument("--header", action="append", type=_header, metavar="'NAME: VALUE'",
                   help="extra request header, repeatable (sent to the proxy; end-to-end headers reach the backend)")
    p.add_argument("--semantic", action="store_true",
                   help="also grade invalid answers in semantic mode (loads the embedding model when installed)")
    p.add_argument("--fail-open", action="store_true",
                   help="serve a pair unperturbed when a perturber fails (default: strict — the pair is recorded "
                        "as failed and retried on the next run, so no arm silently mixes in unperturbed answers)")
    p.add_argument("--token-counter", default="auto",
                   help="how the in-process proxy counts tokens for budgets (pad-*, long_*): 'auto' (default: the "
                        "backend's own tokenizer via /tokenize when it offers one, else the estimate with a warning), "
                        "'upstream', 'estimate', 'tiktoken:<encoding or /path/file.tiktoken>' (OpenAI models, e.g. "
                        "tiktoken:o200k_base for GPT-4o; files from `make tiktoken-files`, never downloaded) or "
                        "'tokenizer:/path/tokenizer.json' (the served model's); the counter used is recorded in "
                        "the results file and shown by the report")
    p.add_argument("--allow-estimate", action="store_true",
                   help="let arms that fill a token budget (catalog padding pad-*, long responses resp-*, long "
                        "conversations conv-*, any profile with such a step; with --proxy, that proxy's counter) run "
                        "with it counted by the estimate (refused without it: budgets are meant in the model's own "
                        "tokens, and the estimate over-counts them 1.17-1.5x); the report still names the counter "
                        "and the tokens each arm reached")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
