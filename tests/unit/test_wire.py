"""Wire format: golden payloads pin the msgpack encoding; decoding is strict but
forward compatible (unknown fields are ignored, unknown tags are refused)."""

from __future__ import annotations

import msgspec
import pytest

from foundation import wire

# ---------------------------------------------------------------- golden payloads
#
# Each expected payload is written out field by field. A renamed, reordered or
# removed field, or a changed tag, changes these bytes. Append-only changes (a new
# field with a default at the end) also change them, on purpose: update the golden
# bytes deliberately when the protocol grows.

PULL_SOURCE = wire.PullSource(handle="ab" * 16, address="tcp://10.0.0.1:5000", num_tokens=3,
                              block_size=16, prompt_digest="d")

GENERATE_REQUEST = wire.GenerateRequest(
    request_id="r1",
    prompt_token_ids=[1, 2, 300],
    sampling=wire.SamplingSpec(max_tokens=8, temperature=0.5, seed=7, stop_token_ids=[2]),
    cache_salt="s",
    hold_blocks=False,
    pull_from=PULL_SOURCE,
)
GENERATE_REQUEST_V1_HEX = (  # before ``trace_context`` was appended
    "87"  # map of 7: tag + 6 fields
    "a474797065" "a867656e6572617465"  # type: "generate"
    "aa726571756573745f6964" "a27231"  # request_id: "r1"
    "b070726f6d70745f746f6b656e5f696473" "930102cd012c"  # prompt_token_ids: [1, 2, 300]
    "a873616d706c696e67" "88"  # sampling: map of 8
    "aa6d61785f746f6b656e73" "08"  # max_tokens: 8
    "ab74656d7065726174757265" "cb3fe0000000000000"  # temperature: 0.5
    "a5746f705f70" "cb3ff0000000000000"  # top_p: 1.0
    "a473656564" "07"  # seed: 7
    "aa6d696e5f746f6b656e73" "00"  # min_tokens: 0
    "aa69676e6f72655f656f73" "c2"  # ignore_eos: false
    "ae73746f705f746f6b656e5f696473" "9102"  # stop_token_ids: [2]
    "a86c6f6770726f6273" "c0"  # logprobs: nil
    "aa63616368655f73616c74" "a173"  # cache_salt: "s"
    "ab686f6c645f626c6f636b73" "c2"  # hold_blocks: false
    "a970756c6c5f66726f6d" "85"  # pull_from: map of 5
    "a668616e646c65" "d920" + "6162" * 16 +  # handle: "abab…" (32 chars)
    "a761646472657373" "b37463703a2f2f31302e302e302e313a35303030"  # address
    "aa6e756d5f746f6b656e73" "03"  # num_tokens: 3
    "aa626c6f636b5f73697a65" "10"  # block_size: 16
    "ad70726f6d70745f646967657374" "a164"  # prompt_digest: "d"
)
GENERATE_REQUEST_V2_HEX = (  # before the sampling's ``tpot_target`` was appended
    "88" + GENERATE_REQUEST_V1_HEX[2:]
    + "ad74726163655f636f6e74657874" "c0"  # trace_context: nil
)
GENERATE_REQUEST_HEX = (
    GENERATE_REQUEST_V2_HEX
    .replace("a873616d706c696e67" "88", "a873616d706c696e67" "89")  # sampling: map of 9
    .replace("a86c6f6770726f6273" "c0",  # logprobs: nil, then
             "a86c6f6770726f6273" "c0" "ab74706f745f746172676574" "cb0000000000000000")  # tpot_target: 0.0
)

GENERATE_CHUNK = wire.GenerateChunk(request_id="r1", token_ids=[5, 6], finished=True, finish_reason="length",
                                    num_prompt_tokens=3, num_cached_tokens=2)
# Before ``transfer`` was appended: such payloads must still decode (append-only rule).
GENERATE_CHUNK_V1_HEX = (
    "89"
    "a474797065" "a56368756e6b"  # type: "chunk"
    "aa726571756573745f6964" "a27231"  # request_id: "r1"
    "a9746f6b656e5f696473" "920506"  # token_ids: [5, 6]
    "a866696e6973686564" "c3"  # finished: true
    "ad66696e6973685f726561736f6e" "a66c656e677468"  # finish_reason: "length"
    "b16e756d5f70726f6d70745f746f6b656e73" "03"  # num_prompt_tokens: 3
    "b16e756d5f6361636865645f746f6b656e73" "02"  # num_cached_tokens: 2
    "ab70756c6c5f736f75726365" "c0"  # pull_source: nil
    "a86c6f6770726f6273" "c0"  # logprobs: nil
)
GENERATE_CHUNK_V2_HEX = (  # before ``num_tier_tokens`` was appended
    "8a" + GENERATE_CHUNK_V1_HEX[2:]
    + "a87472616e73666572" "c0"  # transfer: nil
)
GENERATE_CHUNK_V3_HEX = (  # before ``tier_seconds`` was appended
    "8b" + GENERATE_CHUNK_V2_HEX[2:]
    + "af6e756d5f746965725f746f6b656e73" "00"  # num_tier_tokens: 0
)
GENERATE_CHUNK_HEX = (
    "8c" + GENERATE_CHUNK_V3_HEX[2:]
    + "ac746965725f7365636f6e6473" "cb" + "00" * 8  # tier_seconds: 0.0
)

HEARTBEAT = wire.Heartbeat(worker_id="w0", role="prefill", incarnation="i1", rpc_address="tcp://127.0.0.1:7000",
                           load=wire.WorkerLoad(num_running=1, block_size=16), sent_at=1.5)
HEARTBEAT_V1_HEX = (  # before ``draining`` was appended
    "89"
    "a474797065" "a9686561727462656174"  # type: "heartbeat"
    "a9776f726b65725f6964" "a27730"  # worker_id: "w0"
    "a4726f6c65" "a770726566696c6c"  # role: "prefill"
    "ab696e6361726e6174696f6e" "a26931"  # incarnation: "i1"
    "ab7270635f61646472657373" "b47463703a2f2f3132372e302e302e313a37303030"  # rpc_address
    "a46c6f6164" "87"  # load: map of 7
    "ab6e756d5f72756e6e696e67" "01"  # num_running: 1
    "ab6e756d5f77616974696e67" "00"  # num_waiting: 0
    "b96e756d5f7175657565645f70726566696c6c5f746f6b656e73" "00"  # num_queued_prefill_tokens
    "af6e756d5f667265655f626c6f636b73" "00"  # num_free_blocks
    "b06e756d5f746f74616c5f626c6f636b73" "00"  # num_total_blocks
    "aa626c6f636b5f73697a65" "10"  # block_size: 16
    "af62797465735f7065725f626c6f636b" "00"  # bytes_per_block
    "a773656e745f6174" "cb3ff8000000000000"  # sent_at: 1.5
    "b16b765f6576656e74735f61646472657373" "a0"  # kv_events_address: ""
    "b16d6f64656c5f66696e6765727072696e74" "a0"  # model_fingerprint: ""
)
HEARTBEAT_V2_HEX = (  # before ``transfer_address`` was appended
    "8a" + HEARTBEAT_V1_HEX[2:]
    + "a8647261696e696e67" "c2"  # draining: false
)
HEARTBEAT_V3_HEX = (  # before ``prefill_probe`` was appended
    "8b" + HEARTBEAT_V2_HEX[2:]
    + "b07472616e736665725f61646472657373" "a0"  # transfer_address: ""
)
HEARTBEAT_V4_HEX = (  # before the load's ``queued_prefill`` was appended
    "8c" + HEARTBEAT_V3_HEX[2:]
    + "ad70726566696c6c5f70726f6265" "c0"  # prefill_probe: nil
)
LOAD_V1_LAST = "af62797465735f7065725f626c6f636b" "00"  # bytes_per_block: the load's last field before
HEARTBEAT_V5_HEX = (  # before ``cores`` was appended
    HEARTBEAT_V4_HEX.replace("a46c6f6164" "87", "a46c6f6164" "88", 1)  # load: map of 8
    .replace(LOAD_V1_LAST, LOAD_V1_LAST + "ae7175657565645f70726566696c6c" "c0", 1)  # queued_prefill: nil
)
HEARTBEAT_V6_HEX = (  # before the load's ``prompt_step_cap`` was appended
    "8d" + HEARTBEAT_V5_HEX[2:]
    + "a5636f726573" "c0"  # cores: nil
)
LOAD_V2_LAST = "ae7175657565645f70726566696c6c" "c0"  # queued_prefill: the load's last field before
HEARTBEAT_V7_HEX = (  # before the load's ``head_prompt_age`` was appended
    HEARTBEAT_V6_HEX.replace("a46c6f6164" "88", "a46c6f6164" "89", 1)  # load: map of 9
    .replace(LOAD_V2_LAST, LOAD_V2_LAST + "af70726f6d70745f737465705f636170" "00", 1)  # prompt_step_cap: 0
)
LOAD_V3_LAST = "af70726f6d70745f737465705f636170" "00"  # prompt_step_cap: the load's last field before
HEARTBEAT_V8_HEX = (  # before ``node_store_address`` was appended
    HEARTBEAT_V7_HEX.replace("a46c6f6164" "89", "a46c6f6164" "8a", 1)  # load: map of 10
    .replace(LOAD_V3_LAST, LOAD_V3_LAST + "af686561645f70726f6d70745f616765" "cb" + "00" * 8, 1)  # head_prompt_age: 0.0
)
HEARTBEAT_HEX = (
    "8e" + HEARTBEAT_V8_HEX[2:]
    + "b26e6f64655f73746f72655f61646472657373" "a0"  # node_store_address: ""
)

PULL_BLOCKS = wire.PullBlocks(
    handle="ff" * 16, block_indices=[0, 2],
    layout=wire.KVLayoutSpec(dtype="bfloat16", num_layers=2, block_dim=1, block_shape=[2, 4, 16, 8],
                             block_size=16, bytes_per_block=4096))
PULL_BLOCKS_V1_HEX = (  # before ``host`` was appended
    "84"
    "a474797065" "a470756c6c"  # type: "pull"
    "a668616e646c65" "d920" + "66" * 32 +  # handle: "ff…" (32 chars)
    "ad626c6f636b5f696e6469636573" "920002"  # block_indices: [0, 2]
    "a66c61796f7574" "86"  # layout: map of 6
    "a56474797065" "a862666c6f61743136"  # dtype: "bfloat16"
    "aa6e756d5f6c6179657273" "02"  # num_layers: 2
    "a9626c6f636b5f64696d" "01"  # block_dim: 1
    "ab626c6f636b5f7368617065" "9402041008"  # block_shape: [2, 4, 16, 8]
    "aa626c6f636b5f73697a65" "10"  # block_size: 16
    "af62797465735f7065725f626c6f636b" "cd1000"  # bytes_per_block: 4096
)
PULL_BLOCKS_V2_HEX = (  # before ``checksum`` was appended
    "85" + PULL_BLOCKS_V1_HEX[2:]
    + "a4686f7374" "a0"  # host: ""
)
PULL_BLOCKS_V3_HEX = (  # before ``direct`` was appended
    "86" + PULL_BLOCKS_V2_HEX[2:]
    + "a8636865636b73756d" "c2"  # checksum: false
)
PULL_BLOCKS_V4_HEX = (  # before ``confirms_shared`` was appended
    "87" + PULL_BLOCKS_V3_HEX[2:]
    + "a6646972656374" "c2"  # direct: false
)
PULL_BLOCKS_HEX = (
    "88" + PULL_BLOCKS_V4_HEX[2:]
    + "af636f6e6669726d735f736861726564" "c2"  # confirms_shared: false
)

PULL_HEADER_SHARED = wire.PullHeader(
    ok=True, num_blocks=2, num_layers=30,
    shared_copy=wire.SharedCopyRef(pid=77, fd=9, name="kvroute-lease-ab", num_blocks=5))
PULL_HEADER_SHARED_V1_HEX = (  # before layout, block_indices, frame_bytes and checksum were appended
    "86"
    "a474797065" "ab70756c6c5f686561646572"  # type: "pull_header"
    "a26f6b" "c3"  # ok: true
    "a56572726f72" "a0"  # error: ""
    "aa6e756d5f626c6f636b73" "02"  # num_blocks: 2
    "aa6e756d5f6c6179657273" "1e"  # num_layers: 30
    "ab7368617265645f636f7079" "84"  # shared_copy: map of 4
    "a3706964" "4d"  # pid: 77
    "a26664" "09"  # fd: 9
    "a46e616d65" "b06b76726f7574652d6c656173652d6162"  # name: "kvroute-lease-ab"
    "aa6e756d5f626c6f636b73" "05"  # num_blocks: 5
)
PULL_HEADER_SHARED_HEX = (
    "8b" + PULL_HEADER_SHARED_V1_HEX[2:]
    + "a66c61796f7574" "c0"  # layout: nil
    "ad626c6f636b5f696e6469636573" "90"  # block_indices: []
    "ab6672616d655f6279746573" "00"  # frame_bytes: 0
    "a8636865636b73756d" "c2"  # checksum: false
    "a6646972656374" "c0"  # direct: nil
)

PULL_HEADER_SHARED_ARENA = wire.PullHeader(
    ok=True, num_blocks=2, num_layers=30,
    shared_copy=wire.SharedCopyRef(pid=77, fd=9, name="kvroute-lease-ab", num_blocks=5, offset=8192, pin=3))
PULL_HEADER_SHARED_ARENA_HEX = PULL_HEADER_SHARED_HEX.replace(
    "ab7368617265645f636f7079" "84", "ab7368617265645f636f7079" "86").replace(  # shared_copy: map of 6
    "aa6e756d5f626c6f636b73" "05",
    "aa6e756d5f626c6f636b73" "05"  # num_blocks: 5
    "a66f6666736574" "cd2000"  # offset: 8192 (only where not 0)
    "a370696e" "03")  # pin: 3 (only where not 0)

ERROR_REPLY = wire.ErrorReply(request_id=None, code="bad_request", message="nope")
ERROR_REPLY_HEX = (
    "84"
    "a474797065" "a56572726f72"  # type: "error"
    "aa726571756573745f6964" "c0"  # request_id: nil
    "a4636f6465" "ab6261645f72657175657374"  # code: "bad_request"
    "a76d657373616765" "a46e6f7065"  # message: "nope"
)

LINK_HELLO = wire.LinkHello(
    role="sender", device="cpu", host_id="h/b", backends=["zmq-tcp", "gloo"],
    layout=wire.KVLayoutSpec(dtype="float32", num_layers=30, block_dim=0, block_shape=[2, 3, 128, 64],
                             block_size=128, bytes_per_block=5_898_240))
LINK_HELLO_V1_HEX = (  # before ``kv_encrypted`` was appended
    "87"
    "a474797065" "aa6c696e6b5f68656c6c6f"  # type: "link_hello"
    "a4726f6c65" "a673656e646572"  # role: "sender"
    "a66c61796f7574" "86"  # layout: map of 6
    "a56474797065" "a7666c6f61743332"  # dtype: "float32"
    "aa6e756d5f6c6179657273" "1e"  # num_layers: 30
    "a9626c6f636b5f64696d" "00"  # block_dim: 0
    "ab626c6f636b5f7368617065" "940203cc8040"  # block_shape: [2, 3, 128, 64]
    "aa626c6f636b5f73697a65" "cc80"  # block_size: 128
    "af62797465735f7065725f626c6f636b" "ce005a0000"  # bytes_per_block: 5898240
    "a6646576696365" "a3637075"  # device: "cpu"
    "a7686f73745f6964" "a3682f62"  # host_id: "h/b"
    "a86261636b656e6473" "92" "a77a6d712d746370" "a4676c6f6f"  # backends: ["zmq-tcp", "gloo"]
    "a9726571756573746564" "a46175746f"  # requested: "auto"
)
LINK_HELLO_HEX = (
    "88" + LINK_HELLO_V1_HEX[2:]
    + "ac6b765f656e63727970746564" "c3"  # kv_encrypted: true
)

LINK_SETUP = wire.LinkSetup(backend="zmq-tcp", address="tcp://127.0.0.1:5000")
LINK_SETUP_HEX = (
    "84"
    "a474797065" "aa6c696e6b5f7365747570"  # type: "link_setup"
    "a76261636b656e64" "a77a6d712d746370"  # backend: "zmq-tcp"
    "a761646472657373" "b47463703a2f2f3132372e302e302e313a35303030"  # address
    "a56572726f72" "a0"  # error: ""
)

LINK_CHOICE = wire.LinkChoice(measurement=wire.LinkMeasurement(
    chosen="nixl", candidates=["zmq-ipc", "nixl"], seconds=[0.5, None], probe_bytes=4, set_up_seconds=0.25))
LINK_CHOICE_HEX = (
    "83"
    "a474797065" "ab6c696e6b5f63686f696365"  # type: "link_choice"
    "ab6d6561737572656d656e74" "85"  # measurement: map of 5
    "a663686f73656e" "a46e69786c"  # chosen: "nixl"
    "aa63616e64696461746573" "92" "a77a6d712d697063" "a46e69786c"  # candidates: ["zmq-ipc", "nixl"]
    "a77365636f6e6473" "92" "cb3fe0000000000000" "c0"  # seconds: [0.5, nil]
    "ab70726f62655f6279746573" "04"  # probe_bytes: 4
    "ae7365745f75705f7365636f6e6473" "cb3fd0000000000000"  # set_up_seconds: 0.25
    "a56572726f72" "a0"  # error: ""
)

OPEN_LINK = wire.OpenLink(link_id="abababab", payload=b"\x01\x02")
OPEN_LINK_HEX = (
    "83"
    "a474797065" "a96f70656e5f6c696e6b"  # type: "open_link"
    "a76c696e6b5f6964" "a86162616261626162"  # link_id: "abababab"
    "a77061796c6f6164" "c4020102"  # payload: bin 01 02
)

PULL_OVER_LINK = wire.PullOverLink(handle="ff" * 16, block_indices=[0, 2], layout=PULL_BLOCKS.layout,
                                   link_id="abababab", transfer_id=3)
PULL_OVER_LINK_V1_HEX = (  # before ``checksum`` was appended
    "86"
    "a474797065" "a970756c6c5f6c696e6b"  # type: "pull_link"
    + PULL_BLOCKS_V1_HEX[2 + len("a474797065" "a470756c6c"):]  # handle, block_indices, layout as in PullBlocks
    + "a76c696e6b5f6964" "a86162616261626162"  # link_id: "abababab"
    "ab7472616e736665725f6964" "03"  # transfer_id: 3
)
PULL_OVER_LINK_HEX = (
    "87" + PULL_OVER_LINK_V1_HEX[2:]
    + "a8636865636b73756d" "c2"  # checksum: false
)

TIER_LAYOUT = PULL_BLOCKS.layout
LAYOUT_HEX = PULL_BLOCKS_V1_HEX[PULL_BLOCKS_V1_HEX.index("a66c61796f7574"):]  # layout: map of 6, as in PullBlocks
SHARED_COPY_HEX = (
    "84"
    "a3706964" "07"  # pid: 7
    "a26664" "09"  # fd: 9
    "a46e616d65" "a16e"  # name: "n"
    "aa6e756d5f626c6f636b73"  # num_blocks: (value follows)
)
TIER_PUT = wire.TierPut(keys=[b"\x01" * 16], layout=TIER_LAYOUT,
                        copy=wire.SharedCopyRef(pid=7, fd=9, name="n", num_blocks=1))
TIER_PUT_HEX = (
    "84"
    "a474797065" "a8746965725f707574"  # type: "tier_put"
    "a46b657973" "91" "c410" + "01" * 16  # keys: [bin of 16 bytes]
    + LAYOUT_HEX
    + "a4636f7079" + SHARED_COPY_HEX + "01"  # copy: {pid, fd, name, num_blocks: 1}
)
TIER_GET_REPLY = wire.TierGetReply(arenas=[wire.SharedCopyRef(pid=7, fd=9, name="n", num_blocks=4)],
                                   blocks=[wire.TierBlock(arena=0, offset=1024, checksum=5)])
TIER_GET_REPLY_HEX = (
    "83"
    "a474797065" "ae746965725f6765745f7265706c79"  # type: "tier_get_reply"
    "a66172656e6173" "91" + SHARED_COPY_HEX + "04"  # arenas: [{..., num_blocks: 4}]
    "a6626c6f636b73" "91" "9300cd040005"  # blocks: [[arena 0, offset 1024, checksum 5]] (array-like)
)

GOLDEN = [
    pytest.param(GENERATE_REQUEST, GENERATE_REQUEST_HEX, id="GenerateRequest"),
    pytest.param(GENERATE_CHUNK, GENERATE_CHUNK_HEX, id="GenerateChunk"),
    pytest.param(HEARTBEAT, HEARTBEAT_HEX, id="Heartbeat"),
    pytest.param(PULL_BLOCKS, PULL_BLOCKS_HEX, id="PullBlocks"),
    pytest.param(PULL_HEADER_SHARED, PULL_HEADER_SHARED_HEX, id="PullHeader-shared-copy"),
    pytest.param(PULL_HEADER_SHARED_ARENA, PULL_HEADER_SHARED_ARENA_HEX, id="PullHeader-shared-copy-in-arena"),
    pytest.param(ERROR_REPLY, ERROR_REPLY_HEX, id="ErrorReply"),
    pytest.param(LINK_HELLO, LINK_HELLO_HEX, id="LinkHello"),
    pytest.param(LINK_SETUP, LINK_SETUP_HEX, id="LinkSetup"),
    pytest.param(LINK_CHOICE, LINK_CHOICE_HEX, id="LinkChoice"),
    pytest.param(OPEN_LINK, OPEN_LINK_HEX, id="OpenLink"),
    pytest.param(PULL_OVER_LINK, PULL_OVER_LINK_HEX, id="PullOverLink"),
    pytest.param(TIER_PUT, TIER_PUT_HEX, id="TierPut"),
    pytest.param(TIER_GET_REPLY, TIER_GET_REPLY_HEX, id="TierGetReply"),
]


@pytest.mark.parametrize("message, golden_hex", GOLDEN)
def test_encoding_matches_golden_bytes(message, golden_hex):
    assert wire.encode(message).hex() == golden_hex


@pytest.mark.parametrize("message, golden_hex", GOLDEN)
def test_golden_bytes_decode_to_the_message(message, golden_hex):
    decoded = wire.decode(bytes.fromhex(golden_hex))
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("old_hex, message", [(GENERATE_REQUEST_V1_HEX, GENERATE_REQUEST),
                                              (GENERATE_CHUNK_V1_HEX, GENERATE_CHUNK),
                                              (GENERATE_CHUNK_V2_HEX, GENERATE_CHUNK), (HEARTBEAT_V1_HEX, HEARTBEAT),
                                              (HEARTBEAT_V2_HEX, HEARTBEAT), (HEARTBEAT_V3_HEX, HEARTBEAT),
                                              (HEARTBEAT_V4_HEX, HEARTBEAT), (HEARTBEAT_V5_HEX, HEARTBEAT),
                                              (HEARTBEAT_V6_HEX, HEARTBEAT), (HEARTBEAT_V7_HEX, HEARTBEAT),
                                              (HEARTBEAT_V8_HEX, HEARTBEAT), (GENERATE_CHUNK_V3_HEX, GENERATE_CHUNK),
                                              (PULL_BLOCKS_V1_HEX, PULL_BLOCKS), (PULL_BLOCKS_V2_HEX, PULL_BLOCKS),
                                              (PULL_BLOCKS_V4_HEX, PULL_BLOCKS),
                                              (PULL_HEADER_SHARED_V1_HEX, PULL_HEADER_SHARED),
                                              (PULL_OVER_LINK_V1_HEX, PULL_OVER_LINK),
                                              (LINK_HELLO_V1_HEX, LINK_HELLO),
                                              (GENERATE_REQUEST_V2_HEX, GENERATE_REQUEST)],
                         ids=["GenerateRequest-v1", "GenerateChunk-v1", "GenerateChunk-v2", "Heartbeat-v1",
                              "Heartbeat-v2", "Heartbeat-v3",
                              "Heartbeat-v4", "Heartbeat-v5", "Heartbeat-v6", "Heartbeat-v7", "Heartbeat-v8",
                              "GenerateChunk-v3", "PullBlocks-v1",
                              "PullBlocks-v2", "PullBlocks-v4", "PullHeader-v1", "PullOverLink-v1", "LinkHello-v1",
                              "GenerateRequest-v2"])
def test_payload_from_before_an_appended_field_still_decodes(old_hex, message):
    assert wire.decode(bytes.fromhex(old_hex)) == message


@pytest.mark.parametrize("message, golden_hex", GOLDEN)
def test_decode_accepts_memoryview(message, golden_hex):
    assert wire.decode(memoryview(bytes.fromhex(golden_hex))) == message


ROUND_TRIP = [
    wire.GenerateRequest(request_id="x", prompt_token_ids=[0]),
    wire.GenerateRequest(request_id="x", prompt_token_ids=[9, 8], hold_blocks=True, cache_salt=None),
    wire.GenerateRequest(request_id="x", prompt_token_ids=[1], trace_context={
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v"}),
    wire.AbortRequest(request_id="x"),
    wire.StatsRequest(),
    wire.GenerateChunk(request_id="x", token_ids=[], pull_source=PULL_SOURCE,
                       logprobs=[wire.TokenLogprobs(token_ids=[3, 4], logprobs=[-0.25, -1.5])]),
    wire.GenerateChunk(request_id="x", token_ids=[1], transfer=wire.PullRecord("x-1", "tcp://h:1", 4096, 0.25, ok=True,
                                                                               started_at=1.7e9)),
    wire.ErrorReply(request_id="x", code="engine_error", message="boom"),
    wire.WorkerStats(worker_id="w", role="decode", incarnation="i", load=wire.WorkerLoad(num_free_blocks=7),
                     transfer=wire.TransferCounters(bytes_sent=1 << 40, pulls_failed=2),
                     prompt_tokens=wire.PromptTokenCounters(computed=5, external_kv_transfer=11)),
    HEARTBEAT,
    wire.Heartbeat(worker_id="w", role="decode", incarnation="i", rpc_address="tcp://h:1",
                   load=wire.WorkerLoad(num_queued_prefill_tokens=900, queued_prefill={"a": 880, "b": 20},
                                        prompt_step_cap=256), sent_at=2.0),
    wire.Heartbeat(worker_id="w", role="prefill", incarnation="i", rpc_address="tcp://h:1", load=wire.WorkerLoad(),
                   sent_at=3.0, cores=wire.CoreBinding(machine="boot-1", cores=(0, 2))),
    PULL_BLOCKS,
    wire.PullHeader(ok=False, error="no"),
    wire.PullHeader(ok=True, num_blocks=3, num_layers=28),
    wire.ReleaseLease(handle="h", reason="local_hit"),
    wire.ReleaseReply(released=True),
    wire.TransferStatsRequest(),
    wire.TransferStatsReply(counters=wire.TransferCounters(leases_granted=4), layout=PULL_BLOCKS.layout),
    wire.LinkSetup(backend="gloo", error="no free port"),
]


@pytest.mark.parametrize("message", ROUND_TRIP, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    decoded = wire.decode(wire.encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_every_message_type_has_a_distinct_tag():
    tags = [kind.__struct_config__.tag for kind in wire.Message.__args__]
    assert len(tags) == len(set(tags))


# ---------------------------------------------------------------- strict decoding


def _packed(data) -> bytes:
    return msgspec.msgpack.encode(data)


MALFORMED = [
    pytest.param(b"", id="empty"),
    pytest.param(b"\xc1", id="reserved-byte"),
    pytest.param(b"\x00\xff garbage \x13\x37", id="garbage"),
    pytest.param(bytes.fromhex(ERROR_REPLY_HEX)[:-3], id="truncated"),
    pytest.param(bytes.fromhex(ERROR_REPLY_HEX) + b"\x00", id="trailing-bytes"),
    pytest.param(_packed([1, 2, 3]), id="array-not-map"),
    pytest.param(_packed("generate"), id="bare-string"),
    pytest.param(_packed({"request_id": "r"}), id="no-tag"),
    pytest.param(_packed({"type": "bogus", "request_id": "r"}), id="unknown-tag"),
    pytest.param(_packed({"type": 7}), id="tag-not-a-string"),
    pytest.param(_packed({"type": "abort", "request_id": 5}), id="wrong-type-request-id"),
    pytest.param(_packed({"type": "abort"}), id="missing-required-field"),
    pytest.param(_packed({"type": "generate", "request_id": "r", "prompt_token_ids": "1 2 3"}),
                 id="wrong-type-prompt"),
    pytest.param(_packed({"type": "generate", "request_id": "r", "prompt_token_ids": [1, 2.5]}),
                 id="float-token"),
    pytest.param(_packed({"type": "generate", "request_id": "r", "prompt_token_ids": [1],
                          "sampling": {"max_tokens": "8"}}), id="wrong-type-nested"),
    pytest.param(_packed({"type": "pull", "handle": "h", "block_indices": [0], "layout": None}),
                 id="nil-required-struct"),
    pytest.param(_packed({"type": "release_reply", "released": 1}), id="int-not-bool"),
    # msgspec raises UnicodeDecodeError / RecursionError for these, not DecodeError.
    pytest.param(b"\x81\xa4type\xaetransfer_stat\xff", id="invalid-utf8-tag"),
    pytest.param(b"\x82\xa4type\xa5abort\xaarequest_id\xa2\xc3\x28", id="invalid-utf8-field"),
    pytest.param(b"\x82\xa4type\xa5stats\xa1x" + b"\x91" * 2000 + b"\x00", id="deep-unknown-field"),
    pytest.param(b"\x91" * 100_000 + b"\x00", id="deep-array"),
]


@pytest.mark.parametrize("frame", MALFORMED)
def test_malformed_frames_raise_wire_error(frame):
    with pytest.raises(wire.WireError):
        wire.decode(frame)


def test_wire_error_is_a_value_error():
    # Callers that catch ValueError (e.g. error_code) classify it as a bad request.
    assert issubclass(wire.WireError, ValueError)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    payload = {
        "type": "generate",
        "request_id": "r7",
        "prompt_token_ids": [4, 5],
        "sampling": {"max_tokens": 3, "from_the_future": {"nested": [1, 2]}},
        "pull_from": {"handle": "h" * 32, "address": "tcp://a:1", "num_tokens": 2, "block_size": 16,
                      "prompt_digest": "pd", "new_pull_field": 1.25},
        "a_field_added_later": ["x", 1, None],
        "another": {"k": b"\x00\x01"},
    }
    decoded = wire.decode(_packed(payload))
    assert decoded == wire.GenerateRequest(
        request_id="r7", prompt_token_ids=[4, 5], sampling=wire.SamplingSpec(max_tokens=3),
        pull_from=wire.PullSource(handle="h" * 32, address="tcp://a:1", num_tokens=2, block_size=16,
                                  prompt_digest="pd"))


def test_unknown_fields_inside_a_layout_are_ignored():
    payload = msgspec.to_builtins(PULL_BLOCKS)
    payload["layout"]["page_alignment"] = 4096
    payload["priority"] = 3
    assert wire.decode(_packed(payload)) == PULL_BLOCKS


def test_missing_optional_fields_take_their_defaults():
    decoded = wire.decode(_packed({"type": "chunk", "request_id": "r", "token_ids": [1]}))
    assert decoded == wire.GenerateChunk(request_id="r", token_ids=[1])
    assert decoded.finished is False and decoded.pull_source is None and decoded.logprobs is None


# ---------------------------------------------------------------- peek_request_id


PEEK = [
    pytest.param(_packed({"type": "bogus", "request_id": "r9"}), "r9", id="unknown-tag"),
    pytest.param(_packed({"type": "generate", "request_id": "r9", "prompt_token_ids": "oops"}), "r9",
                 id="bad-field"),
    pytest.param(_packed({"request_id": "r9", "extra": 1}), "r9", id="no-tag"),
    pytest.param(bytes.fromhex(GENERATE_CHUNK_HEX), "r1", id="well-formed"),
    pytest.param(_packed({"type": "abort"}), None, id="no-request-id"),
    pytest.param(_packed({"type": "abort", "request_id": 12}), None, id="request-id-not-a-string"),
    pytest.param(_packed([1, 2]), None, id="not-a-map"),
    pytest.param(b"\xc1\xc1", None, id="garbage"),
    pytest.param(b"", None, id="empty"),
    pytest.param(b"\x82\xa4type\xa5abort\xaarequest_id\xa2\xc3\x28", None, id="invalid-utf8"),
    pytest.param(b"\x82\xa4type\xa5stats\xa1x" + b"\x91" * 2000 + b"\x00", None, id="deep-nesting"),
]


@pytest.mark.parametrize("frame, expected", PEEK)
def test_peek_request_id(frame, expected):
    assert wire.peek_request_id(frame) == expected


def test_peek_request_id_on_a_frame_that_decode_refuses():
    frame = _packed({"type": "generate", "request_id": "route-me", "prompt_token_ids": None})
    with pytest.raises(wire.WireError):
        wire.decode(frame)
    assert wire.peek_request_id(frame) == "route-me"


# ---------------------------------------------------------------- to_dict / from_dict


def test_to_dict_is_plain_builtins():
    data = wire.to_dict(PULL_SOURCE)
    assert data == {"handle": "ab" * 16, "address": "tcp://10.0.0.1:5000", "num_tokens": 3,
                    "block_size": 16, "prompt_digest": "d"}
    assert type(data) is dict


@pytest.mark.parametrize("message", [PULL_SOURCE, GENERATE_REQUEST, PULL_BLOCKS, HEARTBEAT],
                         ids=lambda m: type(m).__name__)
def test_to_dict_from_dict_round_trip(message):
    assert wire.from_dict(wire.to_dict(message), type(message)) == message


def test_from_dict_ignores_unknown_keys():
    data = wire.to_dict(PULL_SOURCE) | {"added_later": True}
    assert wire.from_dict(data, wire.PullSource) == PULL_SOURCE


FROM_DICT_ERRORS = [
    pytest.param({"handle": "h", "address": "a", "num_tokens": "3", "block_size": 16}, id="wrong-type"),
    pytest.param({"handle": "h", "address": "a", "block_size": 16}, id="missing-field"),
    pytest.param({"handle": None, "address": "a", "num_tokens": 3, "block_size": 16}, id="none"),
    pytest.param("tcp://a:1", id="not-a-dict"),
    pytest.param([1, 2], id="a-list"),
]


@pytest.mark.parametrize("data", FROM_DICT_ERRORS)
def test_from_dict_errors_raise_wire_error(data):
    with pytest.raises(wire.WireError, match="PullSource"):
        wire.from_dict(data, wire.PullSource)
