"""The into-cache phase of ``kvroute bench transfer`` run through on a tiny layout: a real
producer process stages each path's lease into the arena the connector would use, this
process pulls it by every path, and the warm-up's pulled blocks are checked against the
producer's pattern (a path that put the wrong bytes anywhere fails the run)."""

from __future__ import annotations

import os

import pytest

from foundation import cluster_keys, zmq_auth
from kvroute.bench.transfer_into_cache import NIXL_PATHS, PATHS, SHAREABLE, measure_into_cache
from transfer.transports.nixl_agent import nixl_missing

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def suite_keys():
    """The test session's cluster keys; this process speaks as the orchestrator again afterwards
    (the phase configures it as a worker, as the bench's consumer is)."""
    keys = os.environ["KVROUTE_CLUSTER_KEYS"]
    yield keys
    zmq_auth.configure(cluster_keys.load(keys), "orchestrator")


def test_every_path_pulls_the_producers_blocks_into_the_cache(suite_keys):
    paths = PATHS if not nixl_missing() else tuple(path for path in PATHS if path not in NIXL_PATHS)
    rows = []
    measure_into_cache(suite_keys, bytes_per_token=2 * 2 * 64, num_layers=2, lengths=[128, 384], reps=2,
                       paths=paths, on_row=rows.append)
    assert [(row["path"], row["prompt_tokens"]) for row in rows] == [
        (path, tokens) for tokens in (128, 384) for path in paths]
    for row in rows:
        assert row["bytes"] == row["prompt_tokens"] * 256 and len(row["samples"]) == 2 and row["seconds"] > 0


def test_the_nixl_paths_stage_as_a_producer_forcing_nixl_does_and_the_others_as_the_default():
    assert {path for path in PATHS if not SHAREABLE[path]} == set(NIXL_PATHS)
