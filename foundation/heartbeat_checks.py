"""What a heartbeat must look like before an orchestrator acts on it.

A heartbeat that decodes can still be nonsense: an address no socket can connect to, an
id that is a megabyte of control characters, a load of NaN. The registry refuses such a
beat (``heartbeat_problem``) instead of registering the worker; a worker checks its own
id and addresses with the same rules at start-up, so a misconfigured one fails there.
"""

from __future__ import annotations

import math

from foundation import wire
from foundation.addresses import AddressError, check_peer_address

MAX_NAME_LENGTH = 128  # worker ids and incarnations: they become log text and metric labels
MAX_LISTED_REQUESTS = 65536  # a load's per-request queue; far above any engine's waiting list
MAX_CORES = 4096


def check_name(value: str, what: str) -> None:
    """A worker id or incarnation: 1 to MAX_NAME_LENGTH printable ASCII characters, no spaces."""
    if not value or len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"{what} must have 1 to {MAX_NAME_LENGTH} characters")
    if not (value.isascii() and value.isprintable()) or " " in value:
        raise ValueError(f"{what} must be printable ASCII without spaces")


def heartbeat_problem(beat: wire.Heartbeat) -> str | None:
    """Why ``beat`` cannot be acted on, or None when it can."""
    try:
        check_name(beat.worker_id, "worker_id")
        check_name(beat.incarnation, "incarnation")
        if beat.role not in wire.ROLES:
            raise ValueError(f"unknown role {beat.role[:MAX_NAME_LENGTH]!r}")
        check_peer_address(beat.rpc_address, "rpc_address")
        for what, address in (("kv_events_address", beat.kv_events_address),
                              ("transfer_address", beat.transfer_address)):
            if address:  # optional: a worker without the endpoint says nothing
                check_peer_address(address, what)
        _check_load(beat.load)
        _check_extras(beat)
    except (ValueError, AddressError) as error:
        return str(error)
    return None


def _check_load(load: wire.WorkerLoad) -> None:
    counts = (load.num_running, load.num_waiting, load.num_queued_prefill_tokens, load.num_free_blocks,
              load.num_total_blocks, load.block_size, load.bytes_per_block, load.prompt_step_cap)
    if any(count < 0 for count in counts):
        raise ValueError("load counts must not be negative")
    if not (math.isfinite(load.head_prompt_age) and load.head_prompt_age >= 0):
        raise ValueError("head_prompt_age must be finite and not negative")
    listed = load.queued_prefill
    if listed is not None:
        if len(listed) > MAX_LISTED_REQUESTS:
            raise ValueError(f"queued_prefill lists more than {MAX_LISTED_REQUESTS} requests")
        if any(tokens < 0 for tokens in listed.values()):
            raise ValueError("queued_prefill tokens must not be negative")


def _check_extras(beat: wire.Heartbeat) -> None:
    if not math.isfinite(beat.sent_at):
        raise ValueError("sent_at must be finite")
    probe = beat.prefill_probe
    if probe is not None and not (probe.new_tokens >= 0 and math.isfinite(probe.seconds) and probe.seconds >= 0):
        raise ValueError("prefill_probe must have tokens and seconds that are finite and not negative")
    cores = beat.cores
    if cores is not None:
        check_name(cores.machine, "cores.machine")
        if len(cores.cores) > MAX_CORES or any(core < 0 for core in cores.cores):
            raise ValueError(f"cores must list at most {MAX_CORES} core numbers, none negative")
