"""One local Ray cluster for all of tests/flow (starting one costs seconds; a launch kills
its own actors, so tests do not disturb each other through it)."""
from __future__ import annotations

import os

import pytest

CORES = sorted(os.sched_getaffinity(0))


RAY_OWN_CLEANUP_OFF = {"RAY_kill_child_processes_on_worker_exit": "0",
                       "RAY_process_group_cleanup_enabled": "0"}
"""Ray's own killing of a dead worker's children, turned off so that the tests see what
`launch` guarantees by itself (Ray's defaults differ across versions and miss a worker's
grandchildren)."""


@pytest.fixture(scope="package")
def ray_cluster():
    from mcore_rl.flow.ray_shim import local_ray

    saved = {k: os.environ.get(k) for k in RAY_OWN_CLEANUP_OFF}
    os.environ.update(RAY_OWN_CLEANUP_OFF)
    with local_ray(num_cpus=len(CORES), include_dashboard=False, log_to_driver=False) as ray:
        yield ray
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
