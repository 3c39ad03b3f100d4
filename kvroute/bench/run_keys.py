"""The cluster keys of a benchmark that starts workers and talks to them itself."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from foundation import cluster_keys, zmq_auth


@contextlib.contextmanager
def speaking_to_workers() -> Iterator[str]:
    """Every kvroute process speaks under cluster keys: the folder ``KVROUTE_CLUSTER_KEYS``
    names, else one made for the run (removed after). Workers started inside inherit it
    through the environment; this process speaks to their RPC as the orchestrator does."""
    with cluster_keys.of_this_run() as keys:
        previous = os.environ.get("KVROUTE_CLUSTER_KEYS")
        os.environ["KVROUTE_CLUSTER_KEYS"] = keys
        zmq_auth.configure(cluster_keys.load(keys), "orchestrator")
        try:
            yield keys
        finally:
            if previous is None:
                os.environ.pop("KVROUTE_CLUSTER_KEYS", None)
            else:
                os.environ["KVROUTE_CLUSTER_KEYS"] = previous
