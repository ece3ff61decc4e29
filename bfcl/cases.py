"""Turning a BFCL case id into a chat-completions request (uses the corpus loader in scorers/)."""

from __future__ import annotations

from typing import Any


def case_by_id(case_id: str) -> Any:
    from toolquake.bfcl.corpus import load_case  # filled in by the corpus work

    return load_case(case_id)


def request_for_case(case_id: str) -> dict[str, Any]:
    from toolquake.bfcl.corpus import case_request

    return case_request(case_by_id(case_id))
