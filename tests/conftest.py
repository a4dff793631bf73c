"""Shared test setup: a deterministic hypothesis profile (CI sees the same cases every run)."""

from hypothesis import HealthCheck, settings

import tvmattn  # noqa: F401  (sets TVM's thread count before TVM's runtime starts)

# Compiling a kernel takes 0.1–1 s, so sweeps are kept small.
settings.register_profile("tvmattn", max_examples=30, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("tvmattn")
