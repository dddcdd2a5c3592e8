"""One local Ray cluster for all of tests/roles: starting and stopping one costs seconds per
test, and a launch joins a running cluster (each kills its own actors and processes at the
end, so tests do not disturb each other through it)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def ray_cluster():
    from mcore_rl.flow.ray_shim import local_ray

    with local_ray(include_dashboard=False) as ray:
        yield ray
