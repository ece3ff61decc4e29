"""What the tests share. Test modules import helpers from here, never from each other.

The basics, re-exported here: starting and stopping real processes on loopback, each on a port of its own choosing
(`processes`), reading Prometheus metrics (`metrics`), waiting for a positive signal instead of sleeping
(`waiting`), finding the processes the suite started (`orphans`). `ports`: a port held for a server that must be
told one, a URL that refuses connections. `scratch`: helpers' files (servers' logs, configs), removed at exit.
Per area: `chat`, `shadow`, `live`, `cases`, `server`, `tracing`, `conformance`, `replay`, `multiturn`,
`multiturn_steps`, `sweep`, `report`, `results`, `browser`, `perturbers`, `callformats`, `lengthening`, `hostile`,
`catalogs`, `tokens`, `llama_server`, `backend`, `deploy`."""

from tests.support.metrics import metric_samples, metric_value, metrics_text, scraped
from tests.support.orphans import ORPHAN_MARK, marked_processes
from tests.support.processes import (
    ROOT,
    Proc,
    recorded,
    start_fake_upstream,
    start_process,
    start_proxy,
)
from tests.support.waiting import wait_for

__all__ = [
    "ORPHAN_MARK", "ROOT", "Proc", "marked_processes", "metric_samples", "metric_value", "metrics_text",
    "recorded", "scraped", "start_fake_upstream", "start_process", "start_proxy", "wait_for",
]
