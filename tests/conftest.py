"""Shared test setup: a deterministic hypothesis profile (CI sees the same cases every run), and a
user tuning-log directory of the test session's own (never the developer's ~/.cache)."""

import os
import tempfile

from hypothesis import HealthCheck, settings

os.environ["TVMATTN_TUNING_LOGS"] = tempfile.mkdtemp(prefix="tvmattn-test-logs-")

import tvmattn  # noqa: F401,E402  (sets TVM's thread count before TVM's runtime starts)

# Compiling a kernel takes 0.1–1 s, so sweeps are kept small.
settings.register_profile("tvmattn", max_examples=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("tvmattn")
