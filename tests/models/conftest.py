"""Shared multi-rank worlds are stopped cleanly when the test session ends."""
import pytest

from tests.models.worlds import close_shared_worlds


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_worlds_at_session_end():
    yield
    close_shared_worlds()
