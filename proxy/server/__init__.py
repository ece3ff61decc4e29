"""The request path: routes, upstream client, relay, profiles, metrics, admin API. Knows no scoring rule."""
