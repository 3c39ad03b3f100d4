"""The sharing structure each workload promises, and its lengths within the configured bounds
(counted with ``approx_tokens``, as the generators count by default; a fitted text has its
drawn length or up to two tokens fewer)."""

from __future__ import annotations

from collections import Counter, defaultdict

from foundation import identity
from simulator.requests import pseudo_chat_tokens
from tests.unit.workload_text import shares_substring
from workloads import (
    BatchConfig,
    GeneratedSharedPrefixConfig,
    NoSharingConfig,
    PrefixRepetitionConfig,
    RagConfig,
    SupportChatConfig,
    approx_tokens,
    generate_batch,
    generate_no_sharing,
    generate_prefix_repetition,
    generate_rag,
    generate_shared_prefix,
    generate_support_chat,
)
from workloads.rag import passage, tenant_instructions

SLACK = 2  # tokens a fitted text may fall short of its target
BLOCK = 16  # the simulator's block size


def within(text: str, low: int, high: int) -> bool:
    return low - SLACK <= approx_tokens(text) <= high


def first_block(messages) -> int:
    return identity.block_hashes(pseudo_chat_tokens(messages)[:BLOCK], BLOCK, None)[0]


# ---------------------------------------------------------------- support chat

CHAT = SupportChatConfig(conversations=5, turns_min=2, turns_max=5, system_tokens=80, question_min_tokens=15,
                         question_max_tokens=30, reply_min_tokens=20, reply_max_tokens=40, seed=2)


def conversations(workload):
    turns = defaultdict(list)
    for request in workload:
        turns[request.group].append(request)
    return turns


def test_support_chat_history_grows_turn_by_turn():
    turns = conversations(generate_support_chat(CHAT))
    assert len(turns) == CHAT.conversations
    for requests in turns.values():
        assert [r.turn for r in requests] == list(range(len(requests)))
        assert CHAT.turns_min <= len(requests) <= CHAT.turns_max
        for before, after in zip(requests, requests[1:]):
            assert after.messages[:len(before.messages)] == before.messages
            assert [m["role"] for m in after.messages[len(before.messages):]] == ["assistant", "user"]
            # what a prefix cache sees: turn k's prompt starts with turn k-1's whole prompt
            previous = pseudo_chat_tokens(before.messages)
            assert pseudo_chat_tokens(after.messages)[:len(previous)] == previous
            assert after.arrival_seconds - before.arrival_seconds >= CHAT.think_seconds_min


def test_support_chat_conversations_share_only_the_desk_prompt():
    workload = generate_support_chat(CHAT)
    assert len({r.messages[0]["content"] for r in workload}) == 1
    first_questions = {r.group: r.messages[1]["content"] for r in workload if r.turn == 0}
    assert len(set(first_questions.values())) == CHAT.conversations
    assert within(workload[0].messages[0]["content"], CHAT.system_tokens, CHAT.system_tokens)
    for request in workload:
        for message in request.messages[1:]:
            low, high = ((CHAT.question_min_tokens, CHAT.question_max_tokens) if message["role"] == "user"
                         else (CHAT.reply_min_tokens, CHAT.reply_max_tokens))
            assert within(message["content"], low, high)


def test_support_chat_conversations_overlap_in_time():
    turns = conversations(generate_support_chat(CHAT)).values()
    starts = sorted(requests[0].arrival_seconds for requests in turns)
    ends = sorted(requests[-1].arrival_seconds for requests in turns)
    assert starts[1] < ends[0]  # a second conversation opens before the first one ends


# ---------------------------------------------------------------- rag

RAG = RagConfig(tenants=3, requests=60, corpus_passages=30, passages_per_request=3, instruction_min_tokens=60,
                instruction_max_tokens=120, passage_min_tokens=30, passage_max_tokens=50, question_min_tokens=10,
                question_max_tokens=20, seed=4)


def split_rag_prompt(content: str) -> tuple[list[str], str]:
    """The retrieved passages (each headed ``[pN]``) and the question (headed ``Question:``)."""
    body, asked = content.rsplit("\nQuestion:", 1)
    first, *others = body.split("\n[p")
    return [first] + ["[p" + other for other in others], "Question:" + asked


def test_rag_tenant_prefix_then_corpus_passages_then_question():
    workload = generate_rag(RAG)
    assert {r.tenant for r in workload} == {f"tenant-{t}" for t in range(RAG.tenants)}
    corpus = {passage(RAG, p) for p in range(RAG.corpus_passages)}
    for request in workload:
        assert request.tenant == f"tenant-{request.group}"
        assert request.messages[0]["content"] == tenant_instructions(RAG, request.group)
        retrieved, question = split_rag_prompt(request.messages[1]["content"])
        assert len(set(retrieved)) == RAG.passages_per_request
        assert set(retrieved) <= corpus
        assert within(question, RAG.question_min_tokens, RAG.question_max_tokens)
    assert all(within(p, RAG.passage_min_tokens, RAG.passage_max_tokens) for p in corpus)


def test_rag_tenants_differ_from_the_first_block_and_popular_passages_recur():
    workload = generate_rag(RAG)
    instructions = {r.group: r.messages[0]["content"] for r in workload}
    assert len({text[:24] for text in instructions.values()}) == RAG.tenants
    assert all(within(text, RAG.instruction_min_tokens, RAG.instruction_max_tokens) for text in instructions.values())
    leading = Counter(r.messages[1]["content"].split("\n", 1)[0] for r in workload)
    assert leading.most_common(1)[0][1] >= 5  # Zipf retrieval: one passage often comes first


# ---------------------------------------------------------------- batch

BATCH = BatchConfig(requests=20, instruction_tokens=30, document_min_tokens=100, document_max_tokens=200, seed=5)


def test_batch_arrives_at_once_and_shares_only_the_instruction():
    workload = generate_batch(BATCH)
    assert len(workload) == BATCH.requests and {r.arrival_seconds for r in workload} == {0.0}
    assert len({r.messages[0]["content"] for r in workload}) == 1
    assert within(workload[0].messages[0]["content"], BATCH.instruction_tokens, BATCH.instruction_tokens)
    documents = [r.messages[1]["content"] for r in workload]
    assert len({d[:16] for d in documents}) == len(documents)
    assert all(within(d, BATCH.document_min_tokens, BATCH.document_max_tokens) for d in documents)


# ---------------------------------------------------------------- generated shared prefix

# SGLang's defaults (64 x 16, 2048, 128, 256) are far too big for these machines' tests.
GSP = GeneratedSharedPrefixConfig(groups=4, prompts_per_group=3, system_prompt_tokens=128, question_tokens=16,
                                  output_tokens=8, seed=6)


def assert_grouped(workload, groups: int, per_group: int, system_tokens: int, user_tokens: int, output_tokens: int):
    """``groups`` distinct system turns, ``per_group`` requests each, distinct user turns, exact lengths."""
    assert len(workload) == groups * per_group
    systems = Counter(r.messages[0]["content"] for r in workload)
    assert len(systems) == groups and set(systems.values()) == {per_group}
    assert Counter(r.group for r in workload) == {g: per_group for g in range(groups)}
    assert len({r.question for r in workload}) == len(workload)
    assert len({text[:24] for text in systems}) == groups  # groups differ from the first words
    assert all(within(text, system_tokens, system_tokens) for text in systems)
    assert all(within(r.question, user_tokens, user_tokens) for r in workload)
    assert {r.max_tokens for r in workload} == {output_tokens}
    assert {r.arrival_seconds for r in workload} == {0.0}  # rate=inf by default: all at once
    assert [r.group for r in workload] != sorted(r.group for r in workload)  # shuffled: groups interleave


def test_generated_shared_prefix_groups():
    assert_grouped(generate_shared_prefix(GSP), GSP.groups, GSP.prompts_per_group, GSP.system_prompt_tokens,
                   GSP.question_tokens, GSP.output_tokens)


def test_generated_shared_prefix_defaults_are_sglangs():
    defaults = GeneratedSharedPrefixConfig()
    assert (defaults.groups, defaults.prompts_per_group, defaults.system_prompt_tokens, defaults.question_tokens,
            defaults.output_tokens) == (64, 16, 2048, 128, 256)


# ---------------------------------------------------------------- prefix repetition

REPETITION = PrefixRepetitionConfig(num_prefixes=4, prefix_tokens=64, suffix_tokens=32, repetitions_per_prefix=5,
                                    output_tokens=8, seed=7)


def test_prefix_repetition_counts():
    assert_grouped(generate_prefix_repetition(REPETITION), REPETITION.num_prefixes, REPETITION.repetitions_per_prefix,
                   REPETITION.prefix_tokens, REPETITION.suffix_tokens, REPETITION.output_tokens)
    defaults = PrefixRepetitionConfig()
    assert (defaults.num_prefixes, defaults.prefix_tokens, defaults.suffix_tokens, defaults.output_tokens) == \
        (10, 256, 256, 128)


# ---------------------------------------------------------------- no sharing

NONE_SHARED = NoSharingConfig(requests=40, prompt_min_tokens=60, prompt_max_tokens=150, seed=8)


def test_no_sharing_prompts_share_no_first_block():
    workload = generate_no_sharing(NONE_SHARED)
    assert len({first_block(r.messages) for r in workload}) == len(workload)
    assert len({r.messages[0]["content"].split()[0] for r in workload}) == len(workload)  # unique first word


def test_no_sharing_texts_share_nothing_long():
    texts = ["\n".join(m["content"] for m in r.messages) for r in generate_no_sharing(NONE_SHARED)[:15]]
    for i in range(len(texts)):
        for j in range(i + 1, len(texts)):
            assert shares_substring(texts[i], texts[j], 32) is None, (i, j)


def test_no_sharing_lengths():
    for request in generate_no_sharing(NONE_SHARED):
        total = sum(approx_tokens(m["content"]) for m in request.messages)
        assert NONE_SHARED.prompt_min_tokens - 2 * SLACK <= total <= NONE_SHARED.prompt_max_tokens
