import pytest

from tests.cluster import START_TIMEOUT, start_worker


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    """One prefill and one decode worker with real engines, shared by the whole run."""
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
