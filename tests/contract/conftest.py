import pytest
import zmq


@pytest.fixture
def context():
    """A ZeroMQ context of the test's own, destroyed after it (no socket outlives a test)."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
