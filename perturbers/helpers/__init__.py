"""Helpers the perturbers share, grouped by what they serve.

- `lengthening/`: requests made longer up to a token budget (`budget`: `fit`, `slot`), tool responses padded with
  records (`records`, `record_bank`), conversations padded with filler turns (`filler`, `facts`);
- `toolkit/`: tools added or changed from the corpus pool (`tool_pool`, `twins`);
- `callformat*.py`: format rewriting's call formats, prompt docs, calls rendered as text and parsed back;
- `tokens.py` (token counters), `generator.py` (a model that writes text, with its disk cache), `protected.py`
  (values text edits must leave alone): shared by perturbers of several kinds.

Model text is read with the shared scanners of `toolquake.bfcl` (`pycall`, `jsonscan`). The perturber registry
never imports this package: a helper is loaded only by the perturber that uses it.
"""
