"""toolquake's proxy: routes, relay, profiles, metrics, CLI."""
