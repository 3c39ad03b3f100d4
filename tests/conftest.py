import pytest
import zmq

from tests.cluster import running_workers


@pytest.fixture
def context():
    """A ZeroMQ context of the test's own, destroyed after it (no socket outlives a test)."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One prefill and one decode worker with real engines, shared by one test module (stopped before the next module starts its own)."""
    with running_workers(tmp_path_factory.mktemp("workers"),
                         [("prefill", "0", []), ("decode", "1", ["--pull-timeout-seconds", "3"])]) as workers:
        yield workers
