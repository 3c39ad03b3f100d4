"""Every message kvroute processes exchange, as typed msgspec structs.

One module, one decoder: the orchestrator, the workers and the connector halves that
live inside vLLM's processes all import these types. Structs are tagged (field
``type``) and encoded as msgpack.

Compatibility rule: append fields with defaults, never reorder or remove. Golden
payloads in ``tests/test_wire.py`` pin the encoding.
"""

from __future__ import annotations

import msgspec


class WireError(ValueError):
    """A frame that does not decode into a known message."""


class _Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    pass


# ---------------------------------------------------------------- shared pieces


class SamplingSpec(msgspec.Struct, forbid_unknown_fields=False):
    """The subset of vLLM's SamplingParams kvroute forwards to an engine."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    logprobs: int | None = None
    # Seconds a token the stream should average once it decodes: the engine keeps the steps
    # beside it short enough (worker.decode_guard); 0: no target.
    tpot_target: float = 0.0


class PullSource(msgspec.Struct, forbid_unknown_fields=False):
    """Where a consumer pulls a prefilled prompt's blocks from.

    ``handle`` names a lease on the producer; it carries at least 128 random bits
    because KV blocks are tenant data and the handle is the only credential.
    """

    handle: str
    address: str
    num_tokens: int
    block_size: int
    # Digest of the producer's prompt tokens and cache salt: a consumer whose prompt
    # does not start with the same tokens, or whose namespace differs, never pulls.
    prompt_digest: str = ""


class WorkerLoad(msgspec.Struct, forbid_unknown_fields=False):
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prefill_tokens: int = 0  # prompt tokens still to compute, of requests with no output yet
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 0
    bytes_per_block: int = 0
    # The same tokens per request id, so an orchestrator can tell its own requests from
    # others' and drop those it saw prefilled since (None: a worker that does not say).
    queued_prefill: dict[str, int] | None = None
    # Most prompt tokens the engine computes for one request in a step while others wait
    # (0: a prompt may take whole steps, so queued prompts are served in turn).
    prompt_step_cap: int = 0
    # Seconds the oldest queued prompt has computed since its listed tokens last changed:
    # a prompt alone takes whole engine steps, and its progress inside one shows nowhere else.
    head_prompt_age: float = 0.0


class KVLayoutSpec(msgspec.Struct, forbid_unknown_fields=False, frozen=True):
    """The physical shape of one engine's paged KV cache, exchanged at first contact.

    ``block_shape`` is one layer's shape with the block dimension removed;
    ``block_dim`` is where that dimension sits. Two engines may exchange blocks only
    when their specs are equal.
    """

    dtype: str
    num_layers: int
    block_dim: int
    block_shape: list[int]
    block_size: int
    bytes_per_block: int


# ---------------------------------------------------------------- worker RPC


class GenerateRequest(_Message, tag="generate"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec = msgspec.field(default_factory=SamplingSpec)
    cache_salt: str | None = None
    # Producer role: keep the prompt's blocks under a lease and return a PullSource.
    hold_blocks: bool = False
    # Consumer role: pull the blocks this worker lacks from here.
    pull_from: PullSource | None = None
    # W3C trace context of the orchestrator's span (``traceparent``, maybe ``tracestate``), so
    # the worker's spans join the request's trace (foundation.tracing); None: not traced.
    trace_context: dict[str, str] | None = None


class AbortRequest(_Message, tag="abort"):
    request_id: str


class StatsRequest(_Message, tag="stats"):
    request_id: str = ""


class TokenLogprobs(msgspec.Struct, forbid_unknown_fields=False):
    """Top log-probabilities at one generated position, best first."""

    token_ids: list[int]
    logprobs: list[float]


class PullRecord(msgspec.Struct, forbid_unknown_fields=False):
    """One finished pull on a consumer: what crossed the wire and how long it took."""

    request_id: str  # vLLM's internal id: kvroute's request id plus a suffix
    source: str
    num_bytes: int
    seconds: float
    ok: bool
    started_at: float = 0.0  # wall clock (time.time()) when the pull began; 0: not reported


class GenerateChunk(_Message, tag="chunk"):
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    pull_source: PullSource | None = None
    logprobs: list[TokenLogprobs] | None = None
    # Consumer, first chunk only: the pull that brought this request's prompt blocks.
    transfer: PullRecord | None = None
    # Last chunk only: prompt tokens the engine loaded from the node KV tier (transfer.node_store),
    # a part of num_cached_tokens, and the seconds from its first lookup to the load's end.
    num_tier_tokens: int = 0
    tier_seconds: float = 0.0


class ErrorReply(_Message, tag="error"):
    request_id: str | None
    code: str
    message: str


class LinkMeasurement(msgspec.Struct, forbid_unknown_fields=False):
    """How a link's backend was chosen by measurement: one probe transfer's seconds over each
    candidate, timed by the receiver (``transfer.transports.probing``)."""

    chosen: str
    candidates: list[str]
    seconds: list[float | None]  # per candidate; None: it could not be set up or probed
    probe_bytes: int = 0  # one probe transfer's payload
    set_up_seconds: float = 0.0  # the receiver's whole measurement, link set-ups included


class TransferCounters(msgspec.Struct, forbid_unknown_fields=False):
    """Byte and block counters of one engine's connector, since process start."""

    bytes_sent: int = 0
    blocks_sent: int = 0
    bytes_received: int = 0
    blocks_received: int = 0
    pulls_ok: int = 0
    pulls_failed: int = 0
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    active_leases: int = 0
    active_pulls: int = 0
    leases_staged: int = 0  # leases copied to host buffers, so the engine freed their blocks
    staged_bytes: int = 0  # host bytes held (or being copied) for staged leases now
    links_opened: int = 0  # transport links this end accepted (producer) or opened (consumer)
    shared_pulls: int = 0  # pulls served (producer) or read (consumer) from a shared-memory copy
    # Consumer: pulls refused because the producer's header disagreed with what was asked
    # (layout, layers, blocks, positions, frame size), and pulls whose frame checksum failed.
    pulls_refused: int = 0
    checksum_failures: int = 0
    # The node KV tier (transfer.node_store): loads of prompt blocks from it, and the
    # write-through of new blocks (staged on the engine's thread, then put).
    tier_loads_ok: int = 0
    tier_loads_failed: int = 0
    tier_blocks_loaded: int = 0
    tier_bytes_loaded: int = 0
    tier_load_microseconds: int = 0
    tier_saves_staged: int = 0  # write-throughs begun; each ends in one of the next two
    tier_saves: int = 0
    tier_saves_failed: int = 0
    tier_blocks_written: int = 0  # stored by the store (blocks it already held are not)
    tier_bytes_staged: int = 0
    tier_stage_microseconds: int = 0  # on the engine's thread, before its next step
    # Pulls offered (producer) or READ (consumer) with NIXL straight from a staged lease into
    # the consumer's cache (transfer.direct_reads), and bytes a consumer wrote into its cache
    # from an intermediate buffer (received frames): none for a direct or shared-copy pull.
    direct_pulls: int = 0
    bytes_scattered: int = 0
    # Links whose backend was chosen by measurement ("auto" with nixl on both ends), and the
    # latest such choices, newest last (``transfer.transports.probing``).
    links_measured: int = 0
    link_measurements: list[LinkMeasurement] = []


class PromptTokenCounters(msgspec.Struct, forbid_unknown_fields=False):
    """vLLM's own accounting of where prompt tokens came from."""

    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0


class WorkerStats(_Message, tag="worker_stats"):
    worker_id: str
    role: str
    incarnation: str
    load: WorkerLoad
    transfer: TransferCounters
    prompt_tokens: PromptTokenCounters
    num_active_requests: int = 0
    request_id: str = ""
    transfer_fresh: bool = True  # False: the transfer endpoint was slow; counters are the last seen
    # The worker's node store: its address ("" for none), its counters when it answered in
    # time, else why not.
    node_store_address: str = ""
    node_store: TierCounters | None = None
    node_store_error: str = ""


ROLES = ("prefill", "decode", "unified")  # a worker's role, as heartbeats and settings spell it
# The planner's two pools: workers that prefill prompts, and workers that decode them. A
# unified worker's one engine does both, so it is in both pools.
POOLS = ("prefill", "decode")


def serves(role: str, pool: str) -> bool:
    """Whether a worker of ``role`` belongs to the planner's ``pool``."""
    return role == pool or role == "unified"


class PrefillProbe(msgspec.Struct, forbid_unknown_fields=False):
    """One cold prefill a worker timed at start-up (``worker.prefill_probe``)."""

    new_tokens: int
    seconds: float


class CoreBinding(msgspec.Struct, forbid_unknown_fields=False, frozen=True):
    """The CPU cores an engine's compute threads are bound to (``worker.cores``).

    Engines on one ``machine`` (one kernel, so one numbering of cores) whose ``cores``
    overlap take turns on those cores: each computes slower while the other is busy."""

    machine: str
    cores: tuple[int, ...]


class Heartbeat(_Message, tag="heartbeat"):
    worker_id: str
    role: str
    incarnation: str
    rpc_address: str
    load: WorkerLoad
    sent_at: float
    kv_events_address: str = ""
    model_fingerprint: str = ""
    # Told to stop: finishing the requests it has, refusing new ones (worker.drain).
    draining: bool = False
    # Where its connector serves KV blocks (operators' view; pulls name it in each PullSource).
    transfer_address: str = ""
    # Its start-up prefill timing: calibrates the cost model before its first request.
    prefill_probe: PrefillProbe | None = None
    # The cores its engine computes on; None: not bound to particular cores (or unknown).
    cores: CoreBinding | None = None
    # Its host's node KV store ("" for none): workers naming one address on one host share
    # it, and the orchestrator follows its blocks through any of them.
    node_store_address: str = ""


class SnapshotRequest(_Message, tag="snapshot"):
    """Ask a worker for its resident prefix-cache blocks (to build or resync an index)."""

    request_id: str = ""


class ResidentBlock(msgspec.Struct, array_like=True, forbid_unknown_fields=False):
    """One block in an engine's prefix cache, under vLLM's own (engine) hashes."""

    engine_hash: bytes | int
    parent: bytes | int | None
    token_ids: list[int]
    extra_keys: list | None = None


class KVSnapshot(_Message, tag="kv_snapshot"):
    """Resident blocks as of KV-event sequence number ``seq`` (-1: before any event)."""

    request_id: str
    incarnation: str
    seq: int
    block_size: int
    blocks: list[ResidentBlock]


class ResetCacheRequest(_Message, tag="reset_cache"):
    """Release every lease this worker holds, then empty its engine's prefix cache."""

    request_id: str = ""


class ResetCacheReply(_Message, tag="reset_cache_reply"):
    request_id: str
    reset: bool
    released_leases: int = 0
    # The worker's node store (transfer.node_store), emptied too: the blocks it dropped, or
    # why it could not be reached; both empty for a worker without one.
    store_blocks_dropped: int = 0
    store_error: str = ""


class RegisterReply(_Message, tag="register_reply"):
    """The orchestrator's answer to a heartbeat: is this worker in rotation?"""

    accepted: bool
    reason: str = ""
    orchestrator_id: str = ""


# ---------------------------------------------------------------- transfer plane


class PullBlocks(_Message, tag="pull"):
    handle: str
    block_indices: list[int]
    layout: KVLayoutSpec
    # The consumer's shared-memory host (``transfer.shared_copies.local_host``); a producer
    # on the same host may answer with a SharedCopyRef instead of frames. Empty: frames only.
    host: str = ""
    # Ask for an xxh3 digest of every frame (``transfer.frame_checksums``), checked before it is stored.
    checksum: bool = False
    # The consumer READs staged leases with NIXL straight into its cache (``transfer.direct_reads``);
    # a producer that can offer the lease that way answers with a DirectRef instead of frames.
    direct: bool = False
    # The consumer reads a shared copy from ``SharedCopyRef.offset`` and confirms a pinned one
    # (``ConfirmRead``) after reading it: a producer may then offer leases in its staging arena
    # as shared copies too (``transfer.shared_copies``).
    confirms_shared: bool = False


class SharedCopyRef(msgspec.Struct, forbid_unknown_fields=False, frozen=True, omit_defaults=True):
    """Where a staged lease's copy lies in the producer's memory (``transfer.shared_copies``):
    an anonymous file, open as ``fd`` in process ``pid``, whose link names ``name``; every
    layer's ``num_blocks`` blocks in wire format, one layer after another. Fields at their
    defaults are left out of the encoding, so a ref without them reads as it always did."""

    pid: int
    fd: int
    name: str
    num_blocks: int
    # Where the copy starts in the file: a lease in the staging arena shares its file with
    # other leases. And, for such a lease, the pin that holds its region: nonzero, the read is
    # trusted only once the producer confirmed it (``ConfirmRead``), as a direct READ is.
    offset: int = 0
    pin: int = 0


class DirectRef(msgspec.Struct, forbid_unknown_fields=False, frozen=True):
    """A staged lease's copy in the producer's staging arena, registered with its NIXL agent,
    for one pull to READ (``transfer.direct_exports``): valid only while the lease lives and
    the pull's ``pin`` is held; the consumer confirms with ``ConfirmRead`` before it trusts
    what it read."""

    agent: str  # the producer agent's name
    metadata: bytes  # its partial metadata: connection and the arena's registration, the same for every lease
    arena_address: int  # where the arena starts in the producer's memory
    arena_bytes: int
    layer_offsets: list[int]  # where each layer's copy starts in the arena
    num_blocks: int  # blocks in each layer's copy, in wire format
    pin: int
    digests: bytes | None = None  # per layer, of the requested blocks in wire order, when checksums were asked


class PullHeader(_Message, tag="pull_header"):
    """Answer to PullBlocks; when ``ok``, ``num_layers`` data messages follow, unless
    ``shared_copy`` is set: then the consumer reads the blocks from it and nothing follows.

    The consumer checks every field against what it asked for (``transfer.pull_check``)
    before anything reaches its cache: the producer's layout, the positions it serves, the
    size of each layer's frame, and whether each frame comes with its checksum."""

    ok: bool
    error: str = ""
    num_blocks: int = 0
    num_layers: int = 0
    shared_copy: SharedCopyRef | None = None
    layout: KVLayoutSpec | None = None
    block_indices: list[int] = msgspec.field(default_factory=list)
    frame_bytes: int = 0  # bytes of one layer's frame: the blocks times a layer's bytes per block
    checksum: bool = False  # each frame is preceded by its digest (``transfer.frame_checksums``)
    direct: DirectRef | None = None  # the consumer READs the blocks itself; nothing follows


class ConfirmRead(_Message, tag="confirm_read"):
    """After a READ of a DirectRef: was the lease live and the pin held until now? Sent on the
    connection of the pull, after the READ completed, so a yes covers the whole READ."""

    handle: str
    pin: int


class ConfirmReadReply(_Message, tag="confirm_read_reply"):
    valid: bool
    error: str = ""


class ReleaseLease(_Message, tag="release"):
    handle: str
    reason: str = "ack"


class ReleaseReply(_Message, tag="release_reply"):
    released: bool
    count: int = 0


class ReleaseAllLeases(_Message, tag="release_all"):
    """Operator action: end every lease on this endpoint (e.g. before a cache reset)."""

    reason: str = "reset"


class TransferStatsRequest(_Message, tag="transfer_stats"):
    pass


class PullRecordsRequest(_Message, tag="pull_records"):
    request_id: str  # kvroute's id; matches vLLM's suffixed internal ids


class PullRecordsReply(_Message, tag="pull_records_reply"):
    records: list[PullRecord]


class TransferStatsReply(_Message, tag="transfer_stats_reply"):
    counters: TransferCounters
    layout: KVLayoutSpec | None = None


class LinkHello(_Message, tag="link_hello"):
    """First contact on a transport link: what each end is (see ``transfer.transports.handshake``)."""

    role: str  # "sender" or "receiver"
    layout: KVLayoutSpec
    device: str  # "cpu" or "cuda": where this end's frames live
    host_id: str  # equal on two ends that can share an ipc socket
    backends: list[str]  # the backends this end can run
    requested: str = "auto"  # this end's override, if any
    # This end's ZeroMQ links encrypt KV (cluster keys, transfer encryption on): "auto" then
    # measures nixl, which moves KV in clear, only between two ends on one host.
    kv_encrypted: bool = True


class LinkSetup(_Message, tag="link_setup"):
    """The sender's answer once both hellos agree: which backend, and where to join it."""

    backend: str
    address: str = ""
    error: str = ""  # set when the sender could not host; the receiver fails at once


class LinkChoice(_Message, tag="link_choice"):
    """The receiver's answer after probing each candidate backend: the one both ends keep
    (``measurement.chosen``), or ``error`` when none could be probed."""

    measurement: LinkMeasurement | None = None
    error: str = ""


class OpenLink(_Message, tag="open_link"):
    """A consumer opens a transport link to a producer's transfer endpoint: ``payload`` is
    its first-contact message (an encoded ``LinkHello``); the producer answers on the same
    connection with its own hello and a ``LinkSetup`` (``transfer.link_control``)."""

    link_id: str
    payload: bytes


class PullOverLink(_Message, tag="pull_link"):
    """``PullBlocks`` whose layers travel over the consumer's open link ``link_id``
    instead of this connection; the header still comes back here. ``transfer_id`` numbers
    the link's transfers, so both ends agree which one the frames belong to."""

    handle: str
    block_indices: list[int]
    layout: KVLayoutSpec
    link_id: str
    transfer_id: int
    checksum: bool = False  # as PullBlocks.checksum, for the transfer over the link



# ---------------------------------------------------------------- node KV tier (transfer.node_store)
#
# Blocks are named by kvroute's namespaced chain hashes (``foundation.identity``), as 16
# little-endian bytes each: the hash covers the cache salt and every earlier token, so a
# tenant's key never names another tenant's block.


class TierLookup(_Message, tag="tier_lookup"):
    """How many of these blocks, from the first, does the node store hold (in any tier)?"""

    keys: list[bytes]


class TierLookupReply(_Message, tag="tier_lookup_reply"):
    num_leading: int


class TierPut(_Message, tag="tier_put"):
    """Store these blocks, skipping those already held. They lie in ``copy`` (the writer's
    memfd: every layer's blocks in wire format, one layer after another, as a staged lease)
    when the writer shares the store's host, else in the one frame that follows."""

    keys: list[bytes]
    layout: KVLayoutSpec
    copy: SharedCopyRef | None = None


class TierPutReply(_Message, tag="tier_put_reply"):
    """A refused put is answered with an ErrorReply instead (code ``copy_unavailable``: the
    store cannot open ``copy``; send the blocks as a frame)."""

    stored: int = 0
    present: int = 0  # already held, not written again
    no_room: int = 0  # every host block was pinned by readers


class TierGet(_Message, tag="tier_get"):
    """Where these blocks lie. ``host``: the reader's shared-memory host
    (``transfer.memfd.local_host``); when it is the store's, the answer names the arenas
    to read from, else one frame per block follows it."""

    keys: list[bytes]
    layout: KVLayoutSpec
    host: str = ""


class TierBlock(msgspec.Struct, array_like=True, forbid_unknown_fields=False):
    arena: int  # index into TierGetReply.arenas; -1: the block comes as a frame
    offset: int  # of the block's slot in the arena
    checksum: int  # xxh3-64 of the block's bytes, for the reader to check


class TierGetReply(_Message, tag="tier_get_reply"):
    """The blocks asked for, in order, each pinned (not evicted) for a few seconds. A get
    the store cannot serve whole is answered with an ErrorReply instead."""

    arenas: list[SharedCopyRef] = msgspec.field(default_factory=list)
    blocks: list[TierBlock] = msgspec.field(default_factory=list)


class TierEvent(msgspec.Struct, array_like=True, forbid_unknown_fields=False):
    stored: bool  # False: removed
    tier: str  # "host" or "disk"
    key: bytes  # the block's namespaced chain hash (foundation.identity), 16 bytes little-endian


class TierEventsRequest(_Message, tag="tier_events"):
    """The blocks a node store stored and removed after event ``since`` of its run
    ``epoch``. Sent to a worker, which asks its node store. A store of another run, or one
    that no longer keeps those events, answers with a snapshot instead."""

    request_id: str = ""
    since: int = 0
    epoch: str = ""


class TierEventsReply(_Message, tag="tier_events_reply"):
    request_id: str = ""
    epoch: str = ""  # the store's run
    seq: int = 0  # of its latest event: the next request's ``since``
    # True: ``events`` are every block the store holds, as stored: they replace what the
    # reader knew of the store instead of being applied to it.
    snapshot: bool = False
    events: list[TierEvent] = msgspec.field(default_factory=list)


class TierCounters(msgspec.Struct, forbid_unknown_fields=False):
    """What a node store holds and has done since it started."""

    block_bytes: int = 0
    host_blocks: int = 0
    host_capacity: int = 0
    disk_blocks: int = 0
    disk_capacity: int = 0
    lookups: int = 0
    lookup_hits: int = 0  # blocks found by lookups
    puts: int = 0
    blocks_stored: int = 0
    blocks_present: int = 0  # offered by a put but already held
    gets: int = 0
    gets_failed: int = 0
    blocks_served: int = 0
    demotions: int = 0
    promotions: int = 0
    dropped: int = 0  # evicted from the last tier
    corrupt_blocks: int = 0  # failed their checksum on the way back from disk
    lookup_blocks: int = 0  # blocks asked about by lookups: lookup_hits / lookup_blocks is the hit rate
    resets: int = 0  # emptied by TierReset (an operator's reset-cache)


class TierStatsRequest(_Message, tag="tier_stats"):
    pass


class TierStatsReply(_Message, tag="tier_stats_reply"):
    counters: TierCounters
    layout: KVLayoutSpec | None = None


class TierReset(_Message, tag="tier_reset"):
    """Drop every block the store holds, in every tier."""


class TierResetReply(_Message, tag="tier_reset_reply"):
    blocks_dropped: int = 0


Message = (
    GenerateRequest
    | AbortRequest
    | StatsRequest
    | GenerateChunk
    | ErrorReply
    | WorkerStats
    | Heartbeat
    | RegisterReply
    | SnapshotRequest
    | KVSnapshot
    | ResetCacheRequest
    | ResetCacheReply
    | ReleaseAllLeases
    | PullBlocks
    | PullHeader
    | ReleaseLease
    | ConfirmRead
    | ConfirmReadReply
    | ReleaseReply
    | TransferStatsRequest
    | TransferStatsReply
    | PullRecordsRequest
    | PullRecordsReply
    | LinkHello
    | LinkSetup
    | LinkChoice
    | OpenLink
    | PullOverLink
    | TierLookup
    | TierLookupReply
    | TierPut
    | TierPutReply
    | TierGet
    | TierGetReply
    | TierStatsRequest
    | TierStatsReply
    | TierReset
    | TierResetReply
    | TierEventsRequest
    | TierEventsReply
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)

# msgspec reports invalid UTF-8 in a string as UnicodeDecodeError and deep nesting
# (even inside an ignored unknown field) as RecursionError, not as DecodeError.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes | memoryview) -> Message:
    """Decode one frame; anything malformed or unknown raises WireError."""
    try:
        return _decoder.decode(frame)
    except _DECODE_ERRORS as error:
        raise WireError(f"malformed message: {error}") from error


class _RequestIdOnly(msgspec.Struct, forbid_unknown_fields=False):
    request_id: str | None = None


def peek_request_id(frame: bytes | memoryview) -> str | None:
    """Best-effort request id of a frame that failed to decode, so the error can be routed."""
    try:
        return msgspec.msgpack.decode(frame, type=_RequestIdOnly).request_id
    except _DECODE_ERRORS:
        return None


def to_dict(struct: msgspec.Struct) -> dict:
    """A struct as plain builtins, e.g. to travel inside vLLM's kv_transfer_params."""
    return msgspec.to_builtins(struct)


def from_dict(data: dict, kind: type[msgspec.Struct]):
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as error:
        raise WireError(f"malformed {kind.__name__}: {error}") from error
