"""Tying a live request to a case: by the `X-Toolquake-Case` header, or by content — a user case (`--cases`)
by the hash of its whole conversation and tool names, a BFCL case by the hash of its first user message
with the same tool names. Runs on the request path, so it only looks things up; `quick` answers before the
request is decoded whole, and a request whose tool names no loaded case has is never hashed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from toolquake.proxy.server.state import UNDECIDED, CaseHint

if TYPE_CHECKING:
    from toolquake.perturbers import ChatRequest

log = structlog.get_logger("toolquake.scoring")


def scorable_categories() -> tuple[str, ...]:
    from toolquake.bfcl.corpus import AST_CATEGORIES, RELEVANCE_CATEGORIES

    return AST_CATEGORIES + RELEVANCE_CATEGORIES


def use_corpus_dir(path: str) -> None:
    """Point the corpus loader at `path`: a toolquake cache dir, or the data dir `corpus path` prints."""
    # only the corpus moves: the cache dir (tool pool, results store, generator caches) stays where it is
    os.environ["TOOLQUAKE_CORPUS"] = str(Path(path).expanduser().resolve())


class CaseResolver:
    """(X-Toolquake-Case header, request) → the BFCL case, or None ("unlabeled"). Runs on the hot path."""

    def __init__(self, match_content: bool = True, user_cases: Any = None) -> None:
        self.match_content = match_content
        #: the user cases (`usercases.UserCases`) looked up before the BFCL corpus
        self.user_cases = user_cases
        self.index: Any = None
        #: the tool names of every indexed case (a request with other tools matches none: it is not hashed)
        self.tool_sets: frozenset[frozenset[str]] = frozenset()
        # keyed by ids of the corpus (content matches), never by a header
        self._names: dict[str, frozenset[str]] = {}
        from toolquake.bfcl.corpus import MAX_CASE_ID_LENGTH

        #: a header longer than every real id (BFCL's and the user cases') names no case: refused unread
        self.max_id_length = max([MAX_CASE_ID_LENGTH, *(len(i) for i in getattr(user_cases, "by_id", ()))])

    def load_index(self) -> int:
        """Build the content-hash index of the scorable categories (slow: call it in a thread)."""
        from toolquake.bfcl.corpus import CaseIndex, load_cases

        cases = load_cases(scorable_categories())
        index = CaseIndex(cases)
        self.tool_sets = frozenset(self.tool_names(case) for case in cases)
        self.index = index  # last: a look-up that sees the index sees its tool names
        return len(cases)

    def tool_names(self, case: Any) -> frozenset[str]:
        names = self._names.get(case.id)
        if names is None:
            from toolquake.bfcl.convert import to_openai_tools

            tools, _ = to_openai_tools(case.functions)
            names = self._names[case.id] = frozenset(t["function"]["name"] for t in tools)
        return names

    def __call__(self, header: str | None, request: ChatRequest) -> Any:
        if header:
            return self._by_header(header)
        if not self.match_content:
            return None
        user = self.user_cases
        if user is not None:
            case = user.match(request.messages, request.tools)
            if case is not None:
                return case
        sent = frozenset(str((t.get("function") or {}).get("name")) for t in request.tools if isinstance(t, dict))
        return self._by_content(request.messages, sent)

    def quick(self, header: str | None, hint: CaseHint) -> Any:
        """The case from the header, or from `hint` (the first user message and tool names the typed decode
        gave), before the request is decoded whole; UNDECIDED where a user case has the request's tool names
        (its whole conversation decides)."""
        if header:
            return self._by_header(header)
        if not self.match_content:
            return None
        user = self.user_cases
        if user is not None and hint.tools in user.tool_sets:
            return UNDECIDED
        return self._by_content(hint.messages, hint.tools)

    def _by_header(self, header: str) -> Any:
        from toolquake.bfcl.corpus import load_case

        # nothing keyed by the header is kept: user cases and BFCL's are looked up in tables fixed at start-up
        # (format-sensitivity ids in a byte-bounded cache, once they are checked); an unknown id is unlabeled
        if len(header) > self.max_id_length + 2:  # a real id, perhaps with the blanks around it
            log.warning("unknown_case", case=header[:100], error=f"longer than any case id ({len(header)})")
            return None
        case_id = header.strip()
        user = self.user_cases
        if user is not None and case_id in user.by_id:
            return user.by_id[case_id]
        try:
            return load_case(case_id)
        except (LookupError, FileNotFoundError) as exc:
            log.warning("unknown_case", case=case_id[:100], error=str(exc)[:200])
            return None

    def _by_content(self, messages: list[dict[str, Any]], sent: frozenset[str]) -> Any:
        """The BFCL case whose first user message (hashed only when some case has these tool names) and tool
        names are the request's."""
        index = self.index
        if index is None or sent not in self.tool_sets:
            return None
        for case_id in index.lookup(messages):
            if self._names.get(case_id, sent) != sent:  # its tools are known (all are, once indexed): not these
                continue
            from toolquake.bfcl.corpus import load_case

            case = load_case(case_id)
            if self.tool_names(case) == sent:
                return case
        return None
