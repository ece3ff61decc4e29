"""toolquake: an OpenAI-compatible evaluating proxy for function-calling agents.

The installed layout is one namespace: `toolquake.proxy` (server, live scoring, replay, CLI),
`toolquake.perturbers`, `toolquake.scorers` and the shared BFCL layer `toolquake.bfcl` they both
stand on. docs/architecture.md draws the layers.
"""

__version__ = "0.1.0"
