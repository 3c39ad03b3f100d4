"""Fake vLLM requests and block lists for the scheduler half of the kvroute connector, and a
producer's lease to pull from."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.request import RequestStatus

from transfer.connector_scheduler import ConnectorScheduler
from transfer.request_params import PARAMS_KEY
from transfer.settings import ConnectorSettings

BLOCK_SIZE = 4
PRODUCER_ADDRESS = "tcp://10.1.1.1:6000"
PROMPT = list(range(1000, 1021))  # P + 1 = 21 tokens, P = 20
P = len(PROMPT) - 1


def make_request(request_id="req-1", prompt=PROMPT, params=None, cache_salt=None, num_computed_tokens=0,
                 status=RequestStatus.WAITING):
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(prompt), kv_transfer_params=params,
                           cache_salt=cache_salt, num_computed_tokens=num_computed_tokens, status=status)


def make_blocks(num_cached: int, block_ids):
    """vLLM's KVCacheBlocks: one group; locally cached (hashed) blocks come first."""
    blocks = [SimpleNamespace(block_id=block_id, block_hash=f"hash-{block_id}" if i < num_cached else None)
              for i, block_id in enumerate(block_ids)]
    return SimpleNamespace(blocks=(blocks,))


def new_scheduler(address: str = PRODUCER_ADDRESS) -> ConnectorScheduler:
    return ConnectorScheduler(ConnectorSettings(transfer_address=address), BLOCK_SIZE)


def produce(prompt=PROMPT, cache_salt=None, block_ids=(30, 31, 32, 33, 34, 35), request_id="prod-1"):
    """Run a producer's request_finished; returns (pull_source dict, grant)."""
    producer = new_scheduler()
    request = make_request(request_id, prompt, {PARAMS_KEY: {"hold_blocks": True}}, cache_salt,
                           num_computed_tokens=len(prompt), status=RequestStatus.FINISHED_LENGTH_CAPPED)
    delay_free, params = producer.request_finished(request, list(block_ids))
    assert delay_free is True
    (grant,) = producer.build_connector_meta().grants
    return params[PARAMS_KEY]["pull_source"], grant


def consumer_request(pull_source: dict, request_id="cons-1", prompt=PROMPT, cache_salt=None,
                     num_computed_tokens=0):
    return make_request(request_id, prompt, {PARAMS_KEY: {"pull_from": pull_source}}, cache_salt,
                        num_computed_tokens)
