"""A stand-in for llama-cpp-python's `Llama` (only what proxy/backend/server.py calls for a tool-less request), for
tests of the embedded server's HTTP layer without the model: put this folder first on the server process's
PYTHONPATH. One token per UTF-8 byte; an answer is the word "tok " repeated until `max_tokens`, each token taking
`TOOLQUAKE_STAND_IN_TOKEN_S` seconds (default 0.05), the stopping criterion asked after every token as llama.cpp
does. Never imported by the project itself."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator

TOKEN_S = float(os.environ.get("TOOLQUAKE_STAND_IN_TOKEN_S", "0.05"))
WORD = "tok "


class Llama:
    def __init__(self, model_path: str, **_: Any) -> None:
        self.model_path = model_path

    def n_vocab(self) -> int:
        return 256

    def tokenize(self, text: bytes, add_bos: bool = False, special: bool = False) -> list[int]:
        return list(text)

    def detokenize(self, tokens: list[int]) -> bytes:
        return bytes(tokens)

    def _tokens(self, prompt: list[int], max_tokens: int, stopping_criteria: Callable[[Any, Any], bool] | None,
                **_: Any) -> Iterator[str]:
        for _n in range(max_tokens):
            time.sleep(TOKEN_S)
            yield WORD
            if stopping_criteria is not None and stopping_criteria(prompt, None):
                return

    def create_completion(self, prompt: list[int], *, max_tokens: int, stream: bool = False,
                          stopping_criteria: Callable[[Any, Any], bool] | None = None, **kw: Any) -> Any:
        tokens = self._tokens(prompt, max_tokens, stopping_criteria, **kw)
        if stream:
            return ({"choices": [{"text": piece, "finish_reason": None}]} for piece in tokens)
        pieces = list(tokens)
        return {"choices": [{"text": "".join(pieces), "finish_reason": "length" if len(pieces) == max_tokens
                             else "stop"}], "usage": {"completion_tokens": len(pieces)}}
