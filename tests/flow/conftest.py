"""One local Ray cluster per test module (starting one costs seconds)."""
from __future__ import annotations

import os

import pytest

CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=len(CORES), include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
