"""Scorers: corpus loading, BFCL-compatible AST scoring, semantic matching, error taxonomy."""
