"""The answer side of a model route, one step per concern, as the request side has one perturber per file.

`base.py` holds the interface (`AnswerStep`: what a step needs of an answer, and the hooks it gets) and the
plan of one answer; `path.py` the steps in their order (`STEPS`) and the loop both APIs share; `plain.py`
and `streams.py` the ways an answer goes to the client; `observe.py` the count, log line and observers every
request ends with. The steps: `repair.py`, `restore.py`, `injected.py`, `text_through.py`, `conformance.py`.
See docs/creating-answer-steps.md.
"""
