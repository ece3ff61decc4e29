"""The embedded backend: a model server that runs on CPU for demos and tests."""
