"""Choosing a link's backend by measurement (``transfer.transports.probing``), without sockets:
probe sizes, the sender's check of the receiver's choice, and the whole exchange between two
ends over an in-memory control channel, with link ends that take as long as told to."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from foundation.wire import KVLayoutSpec, LinkChoice, LinkMeasurement, LinkSetup
from transfer.counters import KEPT_MEASUREMENTS, Counters
from transfer.transports import probing
from transfer.transports.errors import LinkRefused, TransportTimeout, seconds_left
from transfer.transports.handshake import send

MiB = 1 << 20
LAYOUT = KVLayoutSpec(dtype="bfloat16", num_layers=30, block_dim=0, block_shape=[2, 3, 128, 64],
                      block_size=128, bytes_per_block=2 * 3 * 128 * 64 * 2 * 30)  # SmolLM2's 2.95 MB


@pytest.mark.parametrize("bytes_per_block, num_layers, frames", [
    (LAYOUT.bytes_per_block, 30, [98_304] * 30),  # one block is nearest 4 MiB
    (MiB, 4, [MiB] * 4),  # four blocks of 1 MiB, a frame of each block's layer per layer
    (64 * MiB, 32, [2 * MiB] * 32),  # a block larger than the target: still one whole block
])
def test_a_probe_is_a_pull_of_the_whole_blocks_nearest_its_target(bytes_per_block, num_layers, frames):
    layout = KVLayoutSpec(dtype="bfloat16", num_layers=num_layers, block_dim=0, block_shape=[1],
                          block_size=16, bytes_per_block=bytes_per_block)
    assert probing.probe_frames(layout) == frames


def measurement(chosen: str) -> LinkMeasurement:
    return LinkMeasurement(chosen=chosen, candidates=["zmq-ipc", "nixl"], seconds=[0.01, 0.002])


def test_the_sender_keeps_what_the_receiver_chose_and_refuses_anything_else():
    probed = {"zmq-ipc": "ipc end", "nixl": "nixl end"}
    assert probing.agreed_end(LinkChoice(measurement=measurement("nixl")), probed) == "nixl end"
    with pytest.raises(LinkRefused, match="chose nixl, which this end did not probe"):
        probing.agreed_end(LinkChoice(measurement=measurement("nixl")), {"zmq-ipc": "ipc end"})
    with pytest.raises(LinkRefused, match="no candidate backend could be probed: none worked"):
        probing.agreed_end(LinkChoice(error="none worked"), probed)


def test_the_log_line_gives_each_candidates_seconds():
    described = probing.describe(LinkMeasurement(chosen="zmq-ipc", candidates=["zmq-ipc", "nixl"],
                                                 seconds=[0.0091, None], probe_bytes=4 * MiB,
                                                 set_up_seconds=0.0412))
    assert described == "probe of 4.0 MiB: zmq-ipc 0.0091 s, nixl failed; set-up 0.041 s"


def test_counters_keep_the_latest_measurements():
    counters = Counters()
    for index in range(KEPT_MEASUREMENTS + 2):
        counters.record_measurement(LinkMeasurement(chosen=str(index), candidates=[], seconds=[]))
    snapshot = counters.snapshot()
    assert snapshot.links_measured == KEPT_MEASUREMENTS + 2
    assert [kept.chosen for kept in snapshot.link_measurements] == [str(i) for i in range(2, KEPT_MEASUREMENTS + 2)]


# ---------------------------------------------------------------- both ends, in memory


class QueueChannel:
    """One end of an in-memory control channel."""

    def __init__(self, outbox: queue.Queue, inbox: queue.Queue):
        self._outbox, self._inbox = outbox, inbox

    def send_bytes(self, payload: bytes) -> None:
        self._outbox.put(payload)

    def receive_bytes(self, deadline: float) -> bytes:
        try:
            return self._inbox.get(timeout=seconds_left(deadline, "a control message"))
        except queue.Empty:
            raise TransportTimeout("no control message") from None


def channel_pair() -> tuple[QueueChannel, QueueChannel]:
    one, other = queue.Queue(), queue.Queue()
    return QueueChannel(one, other), QueueChannel(other, one)


class FakeEnd:
    """A link end of ``backend`` whose every transfer takes ``seconds``."""

    measurement = None

    def __init__(self, backend: str, seconds: float):
        self.backend, self.seconds, self.closed = backend, seconds, False

    def send(self, frame_bytes, fill, deadline, transfer_id=0):
        return sum(frame_bytes)

    def receive(self, frame_bytes, store, deadline, transfer_id=0):
        time.sleep(self.seconds)
        return sum(frame_bytes)

    def close(self) -> None:
        self.closed = True


class Ends:
    """Both ends' candidate links: ``seconds[name]`` per transfer; a name in ``unhostable``
    fails on the sender, one in ``unjoinable`` on the receiver."""

    def __init__(self, seconds: dict[str, float], unhostable=(), unjoinable=()):
        self.seconds, self.unhostable, self.unjoinable = seconds, unhostable, unjoinable
        self.opened: list[FakeEnd] = []

    def host(self, control):
        def host_announced(name: str, deadline: float) -> FakeEnd:
            if name in self.unhostable:
                send(control, LinkSetup(backend=name, error="could not start"))
                raise LinkRefused("could not start")
            send(control, LinkSetup(backend=name, address=f"{name}://here"))
            return self._open(name)
        return host_announced

    def join(self, name: str, setup: LinkSetup, deadline: float) -> FakeEnd:
        if setup.error or name in self.unjoinable:
            raise LinkRefused(f"cannot join {name}")
        return self._open(name)

    def _open(self, name: str) -> FakeEnd:
        end = FakeEnd(name, self.seconds[name])
        self.opened.append(end)
        return end


def measure_both(ends: Ends, candidates=("zmq-ipc", "nixl")):
    """Run both ends' measurement; returns (sender outcome, receiver outcome), each an end or an error."""
    sender_channel, receiver_channel = channel_pair()
    deadline = time.monotonic() + 5
    frames = probing.probe_frames(LAYOUT)
    outcomes = {}

    def run(role, call):
        try:
            outcomes[role] = call()
        except Exception as error:  # noqa: BLE001 - the test asserts on it
            outcomes[role] = error

    sender = threading.Thread(target=run, args=("sender", lambda: probing.measure_as_sender(
        sender_channel, candidates, frames, ends.host(sender_channel), deadline)))
    sender.start()
    run("receiver", lambda: probing.measure_as_receiver(receiver_channel, candidates, frames, ends.join, deadline))
    sender.join(5)
    return outcomes["sender"], outcomes["receiver"]


@pytest.mark.parametrize("seconds, winner", [
    ({"zmq-ipc": 0.02, "nixl": 0.002}, "nixl"),
    ({"zmq-ipc": 0.002, "nixl": 0.02}, "zmq-ipc"),
])
def test_both_ends_keep_the_fastest_and_close_the_rest(seconds, winner):
    ends = Ends(seconds)
    sender, receiver = measure_both(ends)
    assert sender.backend == receiver.backend == winner
    assert sender.measurement == receiver.measurement and receiver.measurement.chosen == winner
    assert [end.backend for end in ends.opened if not end.closed] == [winner, winner]
    assert receiver.measurement.seconds[1 if winner == "nixl" else 0] < 0.01


@pytest.mark.parametrize("unhostable, unjoinable", [(("nixl",), ()), ((), ("nixl",))])
def test_a_candidate_that_fails_on_either_end_is_not_chosen(unhostable, unjoinable):
    ends = Ends({"zmq-ipc": 0.02, "nixl": 0.001}, unhostable, unjoinable)
    sender, receiver = measure_both(ends)
    assert sender.backend == receiver.backend == "zmq-ipc"
    assert receiver.measurement.seconds[1] is None
    assert [end.backend for end in ends.opened if not end.closed] == ["zmq-ipc", "zmq-ipc"]


def test_when_no_candidate_can_be_probed_both_ends_refuse_and_nothing_stays_open():
    ends = Ends({"zmq-ipc": 0.001, "nixl": 0.001}, unhostable=("zmq-ipc",), unjoinable=("nixl",))
    sender, receiver = measure_both(ends)
    assert isinstance(sender, LinkRefused) and isinstance(receiver, LinkRefused)
    assert all(end.closed for end in ends.opened)
