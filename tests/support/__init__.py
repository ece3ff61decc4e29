"""What the tests share: starting and stopping real processes on loopback (`processes`), reading Prometheus
metrics (`metrics`), waiting for a positive signal instead of sleeping (`waiting`), and the check that no process
the suite started outlives it (`orphans`). Test modules import helpers from here, never from each other."""

from tests.support.metrics import metric_samples, metric_value, metrics_text, scraped
from tests.support.orphans import ORPHAN_MARK, marked_processes
from tests.support.processes import (
    ROOT,
    Proc,
    free_port,
    recorded,
    start_fake_upstream,
    start_process,
    start_proxy,
)
from tests.support.waiting import wait_for

__all__ = [
    "ORPHAN_MARK", "ROOT", "Proc", "free_port", "marked_processes", "metric_samples", "metric_value", "metrics_text",
    "recorded", "scraped", "start_fake_upstream", "start_process", "start_proxy", "wait_for",
]
