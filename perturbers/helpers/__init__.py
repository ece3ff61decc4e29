"""Helpers the perturbers share (tool pool, token counting, budgets, call formats, filler, generator).

The perturber registry never imports this package: a helper is loaded only by the perturber that uses it.
"""
