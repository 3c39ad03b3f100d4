"""The pure parts of the transports: backend choice, layout comparison, transfer
headers, the per-peer link table, and how ZeroMQ links pack frames into messages."""

from __future__ import annotations

import pytest

from foundation.wire import KVLayoutSpec, LinkHello
from transfer.kv_layout import LayoutMismatch, check_layouts, layout_differences
from transfer.transports.errors import FrameMismatch, LinkRefused
from transfer.transports.handshake import RECEIVER, SENDER
from transfer.transports.header import TransferHeader
from transfer.transports.links import LinkTable
from transfer.transports.packing import message_groups
from transfer.transports.selection import choose_backend, fastest_candidate, hosted_backends, measured_candidates
from transfer.transports.settings import TransportSettings

LAYOUT = KVLayoutSpec(dtype="bfloat16", num_layers=30, block_dim=0, block_shape=[2, 3, 128, 64],
                      block_size=128, bytes_per_block=2 * 3 * 128 * 64 * 2 * 30)
CPU_BACKENDS = ["fake", "zmq-tcp", "zmq-ipc", "gloo"]
CUDA_BACKENDS = ["fake", "nccl"]


def hello(role=SENDER, device="cpu", host="a", requested="auto", backends=None, kv_encrypted=True) -> LinkHello:
    if backends is None:
        backends = CUDA_BACKENDS if device == "cuda" else CPU_BACKENDS
    return LinkHello(role=role, layout=LAYOUT, device=device, host_id=host, backends=backends, requested=requested,
                     kv_encrypted=kv_encrypted)


@pytest.mark.parametrize("local, remote, chosen", [
    (hello(), hello(RECEIVER), "zmq-ipc"),
    (hello(host="a"), hello(RECEIVER, host="b"), "zmq-tcp"),
    (hello(device="cuda"), hello(RECEIVER, device="cuda", host="b"), "nccl"),
    (hello(device="cuda"), hello(RECEIVER, device="cuda"), "nccl"),  # CUDA frames: NCCL even on one host
    (hello(requested="gloo"), hello(RECEIVER), "gloo"),
    (hello(), hello(RECEIVER, host="b", requested="zmq-tcp"), "zmq-tcp"),
    (hello(requested="zmq-tcp"), hello(RECEIVER, requested="zmq-tcp"), "zmq-tcp"),
], ids=["one-host", "two-hosts", "cuda", "cuda-one-host", "forced-by-sender", "forced-by-receiver", "both-force"])
def test_backend_choice(local, remote, chosen):
    assert choose_backend(local, remote) == chosen
    assert choose_backend(remote, local) == chosen  # both ends reach the same answer


@pytest.mark.parametrize("local, remote, reason", [
    (hello(requested="gloo"), hello(RECEIVER, requested="zmq-tcp"), "force different backends"),
    (hello(device="cuda"), hello(RECEIVER), "between cuda and cpu"),
    (hello(requested="nccl"), hello(RECEIVER), "cannot run on the local end"),
    (hello(requested="zmq-ipc"), hello(RECEIVER, device="cuda", requested="zmq-ipc"), "cannot run on the remote"),
    (hello(requested="carrier-pigeon"), hello(RECEIVER), "unknown transport backend"),
])
def test_refused_choices_say_why(local, remote, reason):
    with pytest.raises(LinkRefused, match=reason):
        choose_backend(local, remote)


def test_nixl_is_never_assumed_faster_only_measured():
    both_take_it = [*CPU_BACKENDS, "nixl"]
    assert choose_backend(hello(backends=both_take_it), hello(RECEIVER, backends=both_take_it)) == "zmq-ipc"
    forced = hello(backends=both_take_it, requested="nixl")
    assert choose_backend(forced, hello(RECEIVER, backends=both_take_it)) == "nixl"


NIXL_TOO = [*CPU_BACKENDS, "nixl"]


@pytest.mark.parametrize("local, remote, candidates", [
    (hello(backends=NIXL_TOO), hello(RECEIVER, backends=NIXL_TOO), ("zmq-ipc", "nixl")),
    (hello(backends=NIXL_TOO, kv_encrypted=False), hello(RECEIVER, host="b", backends=NIXL_TOO, kv_encrypted=False),
     ("zmq-tcp", "nixl")),
    (hello(backends=NIXL_TOO), hello(RECEIVER, host="b", backends=NIXL_TOO), ()),  # would move KV in clear
    (hello(backends=NIXL_TOO, kv_encrypted=False), hello(RECEIVER, host="b", backends=NIXL_TOO), ()),
    (hello(device="cuda", backends=["nccl", "nixl"]), hello(RECEIVER, device="cuda", backends=["nccl", "nixl"]),
     ("nccl", "nixl")),
    (hello(backends=NIXL_TOO), hello(RECEIVER), ()),  # nixl on one end only: as without nixl
    (hello(), hello(RECEIVER, backends=NIXL_TOO), ()),
    (hello(), hello(RECEIVER), ()),
    (hello(backends=NIXL_TOO, requested="zmq-ipc"), hello(RECEIVER, backends=NIXL_TOO), ()),  # forced: no probe
    (hello(backends=NIXL_TOO), hello(RECEIVER, backends=NIXL_TOO, requested="nixl"), ()),
], ids=["one-host", "two-hosts-in-clear", "two-hosts-encrypted", "two-hosts-one-encrypts", "cuda", "sender-only",
        "receiver-only", "neither", "forced-zmq", "forced-nixl"])
def test_auto_measures_the_automatic_choice_against_nixl_only_where_both_ends_run_it(local, remote, candidates):
    assert measured_candidates(local, remote) == candidates
    assert measured_candidates(remote, local) == candidates  # both ends probe the same candidates, in order


@pytest.mark.parametrize("seconds, chosen", [
    ([0.010, 0.004], "nixl"),
    ([0.004, 0.010], "zmq-ipc"),
    ([0.005, 0.005], "zmq-ipc"),  # a tie keeps the automatic choice
    ([None, 0.050], "nixl"),  # the automatic choice could not be probed
    ([0.050, None], "zmq-ipc"),  # nixl could not be set up: as without nixl
    ([None, None], None),
])
def test_the_fastest_measured_candidate_wins(seconds, chosen):
    assert fastest_candidate(("zmq-ipc", "nixl"), seconds) == chosen


def test_measurements_must_match_the_candidates():
    with pytest.raises(ValueError, match="1 measurements for 2 candidates"):
        fastest_candidate(("zmq-ipc", "nixl"), [0.1])


def test_forcing_nixl_without_nixl_cu12_says_what_to_install(monkeypatch):
    from transfer.transports import nixl_backend
    monkeypatch.setattr(nixl_backend, "nixl_missing", lambda: "nixl_cu12 cannot be imported (No module)")
    with pytest.raises(LinkRefused, match=r"backend nixl cannot run on the local end.*nixl_cu12 cannot be imported"):
        choose_backend(hello(requested="nixl"), hello(RECEIVER, backends=[*CPU_BACKENDS, "nixl"]))


def test_layout_differences_name_each_field():
    other = KVLayoutSpec(dtype="float16", num_layers=30, block_dim=0, block_shape=[2, 4, 128, 64],
                         block_size=128, bytes_per_block=LAYOUT.bytes_per_block)
    assert layout_differences(LAYOUT, LAYOUT) == []
    assert layout_differences(LAYOUT, other) == [
        "dtype: local 'bfloat16', remote 'float16'",
        "block_shape: local [2, 3, 128, 64], remote [2, 4, 128, 64]",
    ]
    with pytest.raises(LayoutMismatch, match="dtype: local 'bfloat16', remote 'float16'; block_shape"):
        check_layouts(LAYOUT, other, refusing="the link")


def test_transfer_header_round_trip_and_refusals():
    header = TransferHeader(7, (100, 200, 300))
    header.check(header.pack())
    assert header.total_bytes == 600
    with pytest.raises(FrameMismatch, match="transfer id 8, expected 7"):
        header.check(TransferHeader(8, (100, 200, 300)).pack())
    with pytest.raises(FrameMismatch, match="frame count 2, expected 3; total bytes 300, expected 600"):
        header.check(TransferHeader(7, (100, 200)).pack())
    with pytest.raises(FrameMismatch, match="frame sizes differ"):
        header.check(TransferHeader(7, (200, 100, 300)).pack())
    with pytest.raises(FrameMismatch, match="not a kvroute transfer header"):
        header.check(bytes(len(header.pack())))
    with pytest.raises(FrameMismatch, match="transfer header of 3 bytes"):
        header.check(b"abc")
    with pytest.raises(ValueError):
        TransferHeader(-1, ())


class _End:
    def __init__(self, peer: str):
        self.peer = peer
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_link_table_opens_lazily_once_per_peer_and_replaces_closed_links():
    opened: list[str] = []
    table = LinkTable(lambda peer: opened.append(peer) or _End(peer))
    assert opened == []  # nothing before the first use
    first = table.get("decode-1")
    assert table.get("decode-1") is first and opened == ["decode-1"]
    table.get("decode-2")
    first.closed = True  # a failed transfer closes its link
    again = table.get("decode-1")
    assert again is not first and opened == ["decode-1", "decode-2", "decode-1"]
    table.close_all()
    assert again.closed


MiB = 1 << 20


@pytest.mark.parametrize("frame_bytes, groups", [
    ((), []),
    ((MiB // 4,) * 8, [range(0, 4), range(4, 8)]),  # small frames share a message
    ((MiB,) * 3, [range(0, 1), range(1, 2), range(2, 3)]),
    ((4 * MiB, 10, 10), [range(0, 1), range(1, 3)]),  # a large frame goes alone
    ((10, 4 * MiB, 10), [range(0, 1), range(1, 2), range(2, 3)]),
    ((0, 0, 5), [range(0, 3)]),
])
def test_zmq_message_groups_keep_frame_order(frame_bytes, groups):
    assert message_groups(frame_bytes) == groups


def test_a_larger_message_limit_packs_more_frames_together():  # nixl's messages
    assert message_groups((4 * MiB, 4 * MiB, 10), limit=16 * MiB) == [range(0, 3)]
    assert message_groups((10 * MiB, 10 * MiB, 0), limit=16 * MiB) == [range(0, 1), range(1, 3)]


@pytest.mark.parametrize("settings, hosted", [
    (TransportSettings(), ("nccl", "zmq-ipc", "zmq-tcp", "nixl")),  # what auto may choose, never gloo or fake
    (TransportSettings(backend="gloo"), ("gloo", "zmq-ipc", "zmq-tcp")),
    (TransportSettings(backend="zmq-tcp"), ("zmq-tcp", "zmq-ipc")),
    (TransportSettings(backend="fake"), ("fake", "zmq-ipc", "zmq-tcp")),  # tests force it on both ends
    (TransportSettings(backend="nixl"), ("nixl", "zmq-ipc", "zmq-tcp")),
    (TransportSettings(hosted=("zmq-tcp",)), ("zmq-tcp",)),
])
def test_a_sender_hosts_what_it_was_configured_for(settings, hosted):
    assert hosted_backends(settings) == hosted


@pytest.mark.parametrize("asked", ["gloo", "fake"])
def test_a_backend_the_sender_does_not_host_is_refused_on_both_ends(asked):
    sender = hello(backends=["zmq-tcp", "zmq-ipc"])  # an endpoint without links of its own
    receiver = hello(RECEIVER, requested=asked)
    for local, remote in ((sender, receiver), (receiver, sender)):
        with pytest.raises(LinkRefused, match=f"backend {asked} cannot run on the .* end, or is not one it takes"):
            choose_backend(local, remote)
