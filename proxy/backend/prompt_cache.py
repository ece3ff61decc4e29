"""The embedded backend's prompt reuse: what a request's instance already holds, and a cache of the KV states of
sequences the instances evaluated, kept in memory and shared by all of them (`--cache-ram`), so a prompt that
starts the way an earlier one did is not evaluated again from its first token.

Why a cache: an instance keeps only its last sequence (llama-cpp-python evaluates only the part of a new prompt
past what it shares with it). With requests of several prompt families interleaved over a few instances (an agent
built on two frameworks, a benchmark's categories, several profiles' catalogs), a request often finds every free
instance holding another family, and its system prompt and tools (a thousand tokens and more) are evaluated again:
on a CPU that is most of a small model's time (SmolLM2-135M: ~5 ms of CPU a prompt token, ~19 ms a generated one).
So an instance's sequence is copied here before a request cuts it short (llama.cpp's per-sequence state: the KV
cells, ~23 KB a token for SmolLM2-135M; a copy of 1,200 tokens takes ~40 ms), and a request whose prompt shares a
longer prefix with a kept sequence than with what its instance holds has that state copied into the instance
first (~25 ms). Least recently used out first, bounded in bytes; a kept sequence that a longer one extends is
dropped (the longer one serves every prompt the shorter would).

Same request, same answer, whatever came before: llama.cpp's numbers for a token depend on the batch it was
evaluated in (a token evaluated alone, as every generated token and a one-token rest of a prompt are, gets
other rounding than in a batch: SmolLM2's next-token logits differ by up to ~0.9). So reuse keeps to what a fresh
instance would compute bit for bit: prompts are evaluated in blocks of `BLOCK` tokens from position 0 (the
instances' batch size), an instance's sequence is reusable up to the last whole block of its prompt (never its
answer), and a request resumes at a block boundary, so each of its blocks is evaluated with the same tokens, the
same batch and the same cached keys as a fresh instance would: its logits equal a fresh evaluation's exactly.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy comes with llama-cpp-python; the server imports this module without it (a stand-in)
    import numpy as np

#: prompts are evaluated in blocks of this many tokens (the instances' n_batch), and reused a whole block at a time
BLOCK = 32
#: a sequence is kept, and a kept one restored, only when that saves evaluating at least this many tokens
MIN_TOKENS = 2 * BLOCK


def evaluated(llm: Any) -> np.ndarray | None:
    """The tokens an instance holds in its KV cache (its last sequence, prompt and answer), or None for a
    llama-cpp-python that does not say."""
    ids, n = getattr(llm, "input_ids", None), getattr(llm, "n_tokens", 0)
    if ids is None or not isinstance(n, int) or n <= 0:
        return None
    return ids[:n]


def common_prefix(seen: np.ndarray | None, tokens: np.ndarray) -> int:
    """The length of the common prefix of two token sequences: one vectorised comparison."""
    import numpy as np

    if seen is None:
        return 0
    n = min(len(seen), len(tokens))
    if n == 0:
        return 0
    differ = np.flatnonzero(seen[:n] != tokens[:n])
    return int(differ[0]) if differ.size else n


def whole_blocks(n: int) -> int:
    return n // BLOCK * BLOCK


def start_in(seen: np.ndarray | None, prompt: np.ndarray) -> int:
    """Where a prompt can start from reusable tokens `seen`: the whole blocks they share with it, leaving at least
    one prompt token to evaluate (the logits come from evaluating it)."""
    return whole_blocks(min(common_prefix(seen, prompt), len(prompt) - 1))


class PromptCache:
    """What each instance may reuse of its sequence, and the kept sequences (tokens and llama.cpp state) by
    recency, at most `max_bytes` of state in all (0: none kept), one at most half of that. Thread-safe: request
    threads share it; a state is copied in or out of an instance on the thread that holds the instance, outside
    the lock."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, max_bytes)
        self.bytes = 0
        self._entries: OrderedDict[int, tuple[np.ndarray, Any, int]] = OrderedDict()  # id → tokens, state, size
        self._next = 0
        #: per instance (by id): how many tokens of its sequence are reusable (the whole blocks of its last prompt)
        self._reusable: dict[int, int] = {}
        self._lock = threading.Lock()
        #: what it did, for tests and the curious: sequences kept, restores, prompt tokens they saved evaluating
        self.kept = self.restored = self.restored_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def reusable(self, llm: Any, tokens: list[int] | np.ndarray) -> int:
        """How many of the prompt `tokens` the instance `llm` can start from (`start_in` its reusable tokens)."""
        seen = evaluated(llm)
        if seen is None:
            return 0
        import numpy as np

        return start_in(seen[:self._reusable.get(id(llm), 0)], np.asarray(tokens, dtype=seen.dtype))

    def prepare(self, llm: Any, tokens: list[int]) -> int:
        """Before `llm` (held by the caller) evaluates the prompt `tokens`: keep the sequence it holds when the
        prompt would cut much of it away; restore the kept sequence that gives the prompt the longest start when
        that is longer than what `llm` gives it; cut `llm` to that start. Returns the start (tokens not
        evaluated); llama-cpp-python evaluates the rest in blocks from there."""
        seen = evaluated(llm)
        if seen is None:
            return 0
        import numpy as np

        prompt = np.asarray(tokens, dtype=seen.dtype)
        reusable = self._reusable.pop(id(llm), 0)  # until `finished` says again (an exception: nothing reusable)
        own = start_in(seen[:reusable], prompt)
        if self.max_bytes and reusable - own >= MIN_TOKENS:
            self.keep(llm, seen[:reusable])
        start = own
        found, key, state = self.longest(prompt) if self.max_bytes else (0, None, None)
        usable = whole_blocks(min(found, len(prompt) - 1))
        if state is not None and usable >= own + MIN_TOKENS:
            if restore(llm, key, state, usable):
                start = usable
                with self._lock:
                    self.restored += 1
                    self.restored_tokens += usable - own
            else:
                start = 0
        cut(llm, start)
        return start

    def finished(self, llm: Any, tokens: list[int]) -> None:
        """`llm` evaluated the prompt `tokens` (in blocks from a block boundary) and answered: its prompt's whole
        blocks are reusable."""
        self._reusable[id(llm)] = whole_blocks(len(tokens))

    def longest(self, prompt: np.ndarray) -> tuple[int, np.ndarray | None, Any]:
        """The kept sequence sharing the longest prefix with `prompt`: (that length, its tokens, its state)."""
        with self._lock:
            best, best_id = 0, None
            for entry_id, (key, _state, _size) in self._entries.items():
                n = common_prefix(key, prompt)
                if n > best:
                    best, best_id = n, entry_id
            if best_id is None:
                return 0, None, None
            self._entries.move_to_end(best_id)
            key, state, _size = self._entries[best_id]
            return best, key, state

    def keep(self, llm: Any, key: np.ndarray) -> bool:
        """Copy the state of `llm` into the cache under `key` (its reusable tokens), unless a kept sequence already
        starts with `key` or the state is over half the cache."""
        with self._lock:
            if any(len(old) >= len(key) and common_prefix(old, key) == len(key)
                   for old, _state, _size in self._entries.values()):
                return False
        state = save(llm, self.max_bytes // 2)
        if state is None:
            return False
        self.put(key.copy(), state)
        return True

    def put(self, key: np.ndarray, state: Any) -> None:
        """Add a sequence's state; drop the kept sequences it extends, then the least recently used ones while
        over the bound."""
        size = len(state)
        if size > self.max_bytes // 2:
            return
        with self._lock:
            for entry_id, (old, _state, old_size) in list(self._entries.items()):
                if len(old) <= len(key) and common_prefix(old, key) == len(old):
                    del self._entries[entry_id]
                    self.bytes -= old_size
            self._entries[self._next] = (key, state, size)
            self._next += 1
            self.bytes += size
            self.kept += 1
            while self.bytes > self.max_bytes and self._entries:
                _id, (_key, _state, old_size) = self._entries.popitem(last=False)
                self.bytes -= old_size


def save(llm: Any, max_bytes: int) -> Any:
    """llama.cpp's state of `llm`'s sequence 0 (its KV cells) as a ctypes byte array, or None when it is over
    `max_bytes` or llama.cpp cannot copy it."""
    import llama_cpp

    size = int(llama_cpp.llama_state_seq_get_size(llm.ctx, 0))
    if size <= 0 or size > max_bytes:
        return None
    buf = (ctypes.c_uint8 * size)()
    if int(llama_cpp.llama_state_seq_get_data(llm.ctx, buf, size, 0)) != size:
        return None
    return buf


def restore(llm: Any, key: np.ndarray, state: Any, usable: int) -> bool:
    """Replace `llm`'s sequence with a kept one's first `usable` tokens. False (`llm` then holds nothing) when
    llama.cpp refuses the state."""
    import llama_cpp

    memory = llama_cpp.llama_get_memory(llm.ctx)
    llama_cpp.llama_memory_seq_rm(memory, 0, -1, -1)
    llm.n_tokens = 0
    if int(llama_cpp.llama_state_seq_set_data(llm.ctx, state, len(state), 0)) == 0:
        llama_cpp.llama_memory_seq_rm(memory, 0, -1, -1)
        return False
    llm.input_ids[:usable] = key[:usable]
    llm.n_tokens = usable
    return True


def cut(llm: Any, start: int) -> None:
    """Drop what `llm` holds past its first `start` tokens (llama-cpp-python then evaluates the prompt from
    there: it finds exactly `start` tokens in common)."""
    import llama_cpp

    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), 0, start, -1)
    llm.n_tokens = start
