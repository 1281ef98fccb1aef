"""tests/sim: the simulator's own tests (determinism, faults, oracle, proof that it bites, bounded CI run).

The simulator runs its own ``trio.run`` per simulated run, so these tests are
plain (synchronous) functions, not trio tests.
"""

import pytest


@pytest.fixture(autouse=True)
def _quiet(quiet_runtime_logs):
    """Every sim test runs with the runtime's logs silenced (tests/conftest.py)."""
