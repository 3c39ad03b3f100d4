"""Fixtures of the tests that start real engines."""

import pytest
from transformers import AutoTokenizer

from foundation.model_prep import resolve_model
from orchestrator.worker_client import WorkerClient
from tests.cluster import Clients, running_workers, wait_idle


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One prefill and one decode worker with real engines, shared by one test module (stopped
    before the next module starts its own)."""
    with running_workers(tmp_path_factory.mktemp("workers"),
                         [("prefill", "0", []), ("decode", "1", ["--pull-timeout-seconds", "3"])]) as workers:
        yield workers


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(None))


@pytest.fixture
async def clients(engines):
    """Clients of the module's ``engines``; after the test, nothing may be left behind: no lease
    held on the producer, nothing running anywhere."""
    clients = Clients(WorkerClient(engines["prefill"].rpc_address), WorkerClient(engines["decode"].rpc_address))
    yield clients
    for client in (clients.prefill, clients.decode):
        stats = await wait_idle(client)
        assert stats.transfer.active_leases == 0, stats
        assert stats.transfer.active_pulls == 0, stats
        assert stats.num_active_requests == 0 and stats.load.num_running == 0, stats
    await clients.close()
