"""tests/sim: the simulator's own tests (determinism, faults, oracle, proof that it bites, bounded CI run).

The simulator runs its own ``trio.run`` per simulated run, so these tests are
plain (synchronous) functions, not trio tests.
"""

import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_runtime_logs():
    # The runtime logs every injected fault at WARNING/ERROR; the assertions tell the story.
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(previous)
