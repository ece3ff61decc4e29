"""toolquake's proxy, by job: `server` (the request path), `live` (scoring and shadow twins attached to
a server), `replay` (the harness, reports), `backend` (the embedded model server) and `cli`."""
