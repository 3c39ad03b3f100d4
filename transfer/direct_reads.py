"""A consumer's NIXL READs of a producer's staged lease straight into its paged cache.

With ``--transfer-link nixl`` a consumer whose cache is contiguous host memory asks for
pulls ``direct`` (``block_client.pull_blocks``). A producer that holds the lease in its
staging arena answers with a DirectRef (``transfer.direct_exports``): its agent, the arena's
registration and where each layer's copy lies in the arena. This end then issues one READ
whose descriptor lists, built from the block table (``transfer.direct_descriptors``), take
every requested run of blocks from the arena into the destination rows of every layer: no
buffer in between, on either side. Over UCX's cma transport on one host that is one
``process_vm_readv`` per segment, the same single kernel copy as a shared-copy ``preadv``.

Registrations are made once: this cache (every layer, one registration) on the first READ,
deregistered when the connector shuts down; a producer's agent and arena are loaded on the
first READ from them and kept, since their metadata never changes. The READs run on an agent
of their own (role DIRECT), not the one of this process's nixl links: a link's end drops its
peer's metadata when the link closes, which would drop the arena's with it.

After the READ the consumer does not yet trust its bytes: ``pull_blocks`` asks the producer
(``ConfirmRead``) whether the lease was live and the pin held until then, and with checksums
on, each layer's rows are hashed where they lie and compared with the producer's digests.
Either failing fails the pull, and vLLM recomputes the prompt. Thread-safe: pull threads share it.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from foundation.endpoint_client import PullFailed
from foundation.wire import DirectRef
from transfer.direct_descriptors import layer_segments, read_descriptors, segments_digest
from transfer.kv_layout import PagedKVCache
from transfer.pull_check import CorruptFrame
from transfer.transports.checksums import DIGEST_BYTES
from transfer.transports.errors import PeerLost, TransportError
from transfer.transports.nixl_agent import Agent, agent_for, wait_until
from transfer.transports.nixl_backend import translate
from transfer.transports.nixl_buffers import quarantine

DIRECT = "direct"  # the role of this process's agent for direct READs (see the module's docstring)


class DirectReader:
    def __init__(self, cache: PagedKVCache, host: str):
        """``host``: the address this engine's transfer endpoint binds (where UCX listens)."""
        if not (cache.is_host_memory and all(layer.is_contiguous() for layer in cache.layers)):
            raise ValueError("direct READs need a contiguous host-memory cache")
        self._cache = cache
        self._host = host
        self._agent: Agent | None = None
        self._registration = None  # of this cache, made on the first READ
        self._lock = threading.Lock()
        self._known: set[tuple[str, int]] = set()  # (producer agent, arena address) loaded
        self.num_registrations = 0  # stays 1 after the first READ: the cache is registered once
        self.num_peer_loads = 0  # one per producer arena, however many leases it serves

    def read(self, ref: DirectRef, local_block_ids: list[int], positions: list[int], deadline: float) -> int:
        """READ blocks ``positions`` of the producer's copy into ``local_block_ids``; returns the
        bytes read. Raises PullFailed (CorruptFrame: a layer's digest disagrees); the target
        blocks may then hold part of the copy, and vLLM recomputes them."""
        cache = self._cache
        if len(ref.layer_offsets) != cache.spec.num_layers:
            raise PullFailed(f"a direct copy of {len(ref.layer_offsets)} layers for {cache.spec.num_layers}")
        leads, row_bytes = cache.row_geometry()
        try:
            segments = layer_segments(positions, local_block_ids, ref.num_blocks, cache.num_blocks, leads, row_bytes)
        except IndexError as error:
            raise PullFailed(f"direct read: {error}") from error
        remote_layers = [ref.arena_address + offset for offset in ref.layer_offsets]
        local, remote = read_descriptors(segments, remote_layers, [layer.data_ptr() for layer in cache.layers])
        agent = self._ready(ref)
        try:
            self._read(agent, local, remote, ref.agent, deadline)
        except TransportError as error:
            raise PullFailed(f"direct read from {ref.agent}: {error}") from error
        if ref.digests is not None:
            self._check_digests(ref.digests, segments)
        return int(segments[:, 2].sum()) * cache.spec.num_layers

    def _ready(self, ref: DirectRef) -> Agent:
        """The agent, with this cache registered and ``ref``'s arena known to it."""
        with self._lock:
            if self._agent is None:
                self._agent = agent_for(DIRECT, self._host)
            if self._registration is None:
                self._registration, _ = self._agent.register_for_peers(list(self._cache.layers))
                self.num_registrations += 1
            if (ref.agent, ref.arena_address) not in self._known:
                self._load(ref)
            return self._agent

    def _load(self, ref: DirectRef) -> None:
        """Load the producer's metadata: its first arena makes it a peer; a later one (a
        producer whose arena grew) adds that arena's registration."""
        try:
            if any(agent == ref.agent for agent, _ in self._known):
                self._agent.learn(ref.metadata)
            elif self._agent.add_peer(ref.metadata) != ref.agent:
                raise PullFailed(f"the direct copy's metadata is not that of {ref.agent}")
        except Exception as error:
            translated = translate(error)
            if translated is None:
                raise
            raise PullFailed(f"loading {ref.agent}'s metadata: {translated}") from error
        self._known.add((ref.agent, ref.arena_address))
        self.num_peer_loads += 1

    @staticmethod
    def _read(agent: Agent, local: np.ndarray, remote: np.ndarray, peer: str, deadline: float) -> None:
        try:
            handle = agent.read_lists(local, remote, peer)
        except Exception as error:
            raise (translate(error) or error) from error
        try:
            state = wait_until(lambda: None if (s := agent.state(handle)) == "PROC" else s, deadline,
                               f"a direct READ from {peer}")
        except BaseException:
            try:
                handle.release()  # cancels the READ
            except Exception:  # noqa: BLE001 - it could not be cancelled: keep its handle alive
                quarantine(handle)
            raise
        handle.release()
        if state != "DONE":
            raise PeerLost(f"nixl: a direct READ from {peer} failed")

    def _check_digests(self, digests: bytes, segments: np.ndarray) -> None:
        """Each layer's rows, hashed where the READ put them, against the producer's digest."""
        for index, layer in enumerate(self._cache.layers):
            got = segments_digest(layer.reshape(-1).view(torch.uint8), segments[:, 1], segments[:, 2])
            if got != digests[index * DIGEST_BYTES:(index + 1) * DIGEST_BYTES]:
                raise CorruptFrame(f"layer {index}: the blocks read directly do not match the producer's checksum")

    def close(self) -> None:
        """Deregister this cache (its memory may be freed after); loaded producers stay known."""
        with self._lock:
            if self._registration is not None:
                self._agent.deregister(self._registration)
                self._registration = None
