"""Helpers of the perturbers that add or change tools from the corpus's pool: the pool and its embeddings
(`tool_pool`), functionally equivalent tools kept out (`twins`)."""
