"""A consumer's NIXL READs of a producer's staged lease straight into its paged cache.

With ``--transfer-link nixl`` a consumer whose cache is contiguous host memory asks for
pulls ``direct`` (``block_client.pull_blocks``). A producer that holds the lease staged
answers with a DirectRef (``transfer.direct_exports``): its agent, the copy's registration
and where each layer's copy starts. This end then issues one READ whose descriptor lists,
built from the block table (``transfer.direct_descriptors``), take every requested run of
blocks from the copy into the destination rows of every layer: no buffer in between, on
either side. Over UCX's cma transport on one host that is one ``process_vm_readv`` per
segment, the same single kernel copy as a shared-copy ``preadv``.

Registrations are made once: this cache (every layer, one registration) on the first READ,
and kept for the process's life. A producer's agent is loaded once; each lease's copy adds a
registration to what this agent knows of it, and NIXL offers no way to forget one. A
producer's copies come and go, so a new copy may lie where an old one did, and NIXL then
finds the old registration for a READ of the new one and refuses it (NIXL_ERR_NOT_FOUND).
So the peer is loaded afresh (forgetting every old registration) when that happens, and after
MAX_LEASES_PER_PEER leases, whenever no other READ of it runs; reloading costs a new UCX
connection (~10 ms here), so it is not done for every lease.

After the READ the consumer does not yet trust its bytes: ``pull_blocks`` asks the producer
(``ConfirmRead``) whether the lease was live and the pin held until then, and with checksums
on, each layer's rows are hashed where they lie and compared with the producer's digests.
Either failing fails the pull, and vLLM recomputes the prompt. Thread-safe: pull threads share it.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import torch

from foundation.endpoint_client import PullFailed
from foundation.wire import DirectRef
from transfer.direct_descriptors import layer_segments, read_descriptors, segments_digest
from transfer.kv_layout import PagedKVCache
from transfer.pull_check import CorruptFrame
from transfer.transports.checksums import DIGEST_BYTES
from transfer.transports.errors import PeerLost, TransportError
from transfer.transports.handshake import RECEIVER
from transfer.transports.nixl_agent import Agent, agent_for, wait_until
from transfer.transports.nixl_backend import translate
from transfer.transports.nixl_buffers import quarantine

MAX_LEASES_PER_PEER = 1024


class StaleRegistration(TransportError):
    """NIXL knows no registration of the peer covering the READ (see the module's docstring)."""


class DirectReader:
    def __init__(self, cache: PagedKVCache, host: str):
        """``host``: the address this engine's transfer endpoint binds (where UCX listens)."""
        if not (cache.is_host_memory and all(layer.is_contiguous() for layer in cache.layers)):
            raise ValueError("direct READs need a contiguous host-memory cache")
        self._cache = cache
        self._host = host
        self._agent: Agent | None = None
        self._lock = threading.Lock()
        self._leases_seen: Counter[str] = Counter()  # per producer agent, since it was loaded
        self._reading: Counter[str] = Counter()  # READs running, per producer agent
        self.num_registrations = 0  # stays 1 after the first READ: the cache is registered once


    def read(self, ref: DirectRef, local_block_ids: list[int], positions: list[int], deadline: float) -> int:
        """READ blocks ``positions`` of the producer's copy into ``local_block_ids``; returns the
        bytes read. Raises PullFailed (CorruptFrame: a layer's digest disagrees); the target
        blocks may then hold part of the copy, and vLLM recomputes them."""
        cache = self._cache
        if len(ref.layer_addresses) != cache.spec.num_layers:
            raise PullFailed(f"a direct copy of {len(ref.layer_addresses)} layers for {cache.spec.num_layers}")
        leads, row_bytes = cache.row_geometry()
        try:
            segments = layer_segments(positions, local_block_ids, ref.num_blocks, cache.num_blocks, leads, row_bytes)
        except IndexError as error:
            raise PullFailed(f"direct read: {error}") from error
        local, remote = read_descriptors(segments, ref.layer_addresses, [layer.data_ptr() for layer in cache.layers])
        agent = self._enter(ref)
        try:
            try:
                self._read(agent, local, remote, ref.agent, deadline)
            except StaleRegistration:
                self._reload(ref)
                self._read(agent, local, remote, ref.agent, deadline)
        except TransportError as error:
            raise PullFailed(f"direct read from {ref.agent}: {error}") from error
        finally:
            self._leave(ref.agent)
        if ref.digests is not None:
            self._check_digests(ref.digests, segments)
        return int(segments[:, 2].sum()) * cache.spec.num_layers

    def _enter(self, ref: DirectRef) -> Agent:
        """The agent, with this cache registered and ``ref``'s copy known to it."""
        with self._lock:
            if self._agent is None:
                self._agent = agent_for(RECEIVER, self._host)
                self._agent.register_for_peers(list(self._cache.layers))  # kept: never deregistered
                self.num_registrations += 1
            agent = self._agent
            try:
                if self._leases_seen[ref.agent] == 0:
                    if agent.add_peer(ref.metadata) != ref.agent:
                        raise PullFailed(f"the direct copy's metadata is not that of {ref.agent}")
                else:
                    agent.learn(ref.metadata)
            except Exception as error:
                translated = translate(error)
                if translated is None:
                    raise
                raise PullFailed(f"loading {ref.agent}'s metadata: {translated}") from error
            self._leases_seen[ref.agent] += 1
            self._reading[ref.agent] += 1
            return agent

    def _reload(self, ref: DirectRef) -> None:
        """Forget what the peer's old copies registered; PullFailed if another READ of it runs."""
        with self._lock:
            if self._reading[ref.agent] > 1:
                raise PullFailed(f"a stale registration of {ref.agent} hides this lease's, and another "
                                 "READ of it runs")
            try:
                self._agent.reload_peer(ref.agent, ref.metadata)
            except Exception as error:
                raise PullFailed(f"reloading {ref.agent}'s metadata: {translate(error) or error}") from error
            self._leases_seen[ref.agent] = 1

    def _leave(self, peer: str) -> None:
        with self._lock:
            self._reading[peer] -= 1
            if self._reading[peer] == 0 and self._leases_seen[peer] >= MAX_LEASES_PER_PEER:
                del self._leases_seen[peer], self._reading[peer]
                self._agent.drop_peer(peer)

    @staticmethod
    def _read(agent: Agent, local: np.ndarray, remote: np.ndarray, peer: str, deadline: float) -> None:
        try:
            handle = agent.read_lists(local, remote, peer)
        except Exception as error:
            if type(error).__name__ == "nixlNotFoundError":
                raise StaleRegistration(str(error)) from error
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
