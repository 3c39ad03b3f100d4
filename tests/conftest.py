import pytest

from tests.cluster import START_TIMEOUT, start_worker


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One prefill and one decode worker with real engines, shared by one test module (stopped before the next module starts its own)."""
    log_dir = tmp_path_factory.mktemp("workers")
    workers = [start_worker("prefill", log_dir, "0"),
               start_worker("decode", log_dir, "1", ["--pull-timeout-seconds", "3"])]
    try:
        for worker in workers:
            worker.wait_ready(START_TIMEOUT)
        yield {w.role: w for w in workers}
    finally:
        for worker in workers:
            worker.stop()
