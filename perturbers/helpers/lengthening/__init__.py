"""Helpers of the perturbers that make a request longer up to a token budget: the budget itself (`budget`), tool
responses padded with look-alike or real records (`records`, `record_bank`), conversations padded with filler turns
that must not hold what the answer needs (`filler`, `facts`)."""
