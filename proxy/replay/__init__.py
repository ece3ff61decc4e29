"""The replay harness: cases × profiles through the proxy, exactly once in SQLite, and the reports."""
