"""The node stores behind the workers, through the orchestrator's admin API: a real
``kvroute node-store`` process shared by two synthetic workers (which report and reset it as
real workers do). ``GET /admin/stores`` lists it once, with both workers, its capacity, use
and hit rate, and the orchestrator's index of it follows its blocks through the workers;
``POST /admin/reset-cache`` empties it; a store that is gone is listed with why, and nothing
is indexed there any more."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from foundation import wire
from foundation.launcher import launch_node_store
from foundation.model_prep import resolve_model
from foundation.netutil import free_port, tcp
from testing.stack import running_synthetic_stack
from transfer.node_store.client import NodeStoreClient

LAYOUT = wire.KVLayoutSpec(dtype="float32", num_layers=2, block_dim=1, block_shape=[2, 8, 4, 16],
                           block_size=8, bytes_per_block=2 * 2 * 8 * 4 * 16 * 4)


@pytest.fixture
def node_store(tmp_path):
    address = tcp("127.0.0.1", free_port())
    store = launch_node_store(["--bind", address, "--host-kv-gib", "0.001"], tmp_path / "store")
    store.wait_ready(30)
    client = NodeStoreClient(address)
    yield store, client
    client.close()
    store.stop()


def put_blocks(client: NodeStoreClient, count: int) -> None:
    keys = [bytes([i + 1]) * 16 for i in range(count)]
    data = np.random.default_rng(0).integers(0, 255, count * LAYOUT.bytes_per_block, dtype=np.uint8)
    assert client.put(keys, LAYOUT, None, memoryview(data)).stored == count
    assert client.leading([*keys, b"\xff" * 16]) == count  # 3 blocks asked, 2 found


def stores(url: str) -> list[dict]:
    response = httpx.get(url + "/admin/stores", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["stores"]


def listed_when(url: str, ready, timeout: float = 10.0) -> dict:
    """The one store listed, once ``ready(entry)`` holds (the index follows within a poll)."""
    deadline = time.monotonic() + timeout
    while True:
        (entry,) = stores(url)
        if ready(entry) or time.monotonic() > deadline:
            return entry
        time.sleep(0.1)


def test_a_shared_store_is_listed_once_emptied_by_reset_cache_and_missed_when_gone(tmp_path, node_store):
    store, client = node_store
    put_blocks(client, 2)
    with running_synthetic_stack(resolve_model(None), tmp_path / "stack.log", [], token_seconds=0.01,
                                 roles=("unified", "unified"), worker_args=("--node-store", client.address)) as stack:
        listed = listed_when(stack.url, lambda entry: entry["indexed"]["host"] == 2)
        assert listed["indexed"] == {"host": 2, "disk": 0}, "the orchestrator follows the store's blocks"
        assert (listed["node"], listed["address"], sorted(listed["workers"])) == (
            "127.0.0.1", client.address, ["unified-0", "unified-1"])
        assert listed["reachable"] and listed["error"] == ""
        capacity = int(0.001 * (1 << 30)) // LAYOUT.bytes_per_block
        assert listed["tiers"] == {"host": {"blocks": 2, "capacity": capacity, "bytes": 2 * LAYOUT.bytes_per_block},
                                   "disk": {"blocks": 0, "capacity": 0, "bytes": 0}}
        assert (listed["lookup_blocks"], listed["lookup_hits"], listed["hit_rate"]) == (3, 2, 2 / 3)

        reset = httpx.post(stack.url + "/admin/reset-cache", json={}, timeout=30)
        assert reset.status_code == 200, reset.text
        dropped = sorted(w.get("store_blocks_dropped", 0) for w in reset.json()["workers"])
        assert dropped == [0, 2], "the first reset of the shared store drops its blocks, the second none"
        after = listed_when(stack.url, lambda entry: entry["indexed"]["host"] == 0)
        assert after["tiers"]["host"]["blocks"] == 0 and after["resets"] == 2
        assert after["indexed"] == {"host": 0, "disk": 0}
        put_blocks(client, 1)
        assert listed_when(stack.url, lambda entry: entry["indexed"]["host"] == 1)["indexed"]["host"] == 1

        store.kill()
        gone = listed_when(stack.url, lambda entry: entry["indexed"]["host"] == 0)
        assert (sorted(gone["workers"]), gone["reachable"]) == (sorted(listed["workers"]), False)
        assert "did not answer" in gone["error"]
        assert gone["indexed"] == {"host": 0, "disk": 0}, "a store out of reach is priced as holding nothing"
