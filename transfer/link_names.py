"""The values ``--transfer-link`` and ``--transfer-checksum`` accept, importable without
torch or ZeroMQ."""

ENDPOINT = "endpoint"  # no link: the layers come back on the connection that asked for them
LINK_CHOICES = (ENDPOINT, "auto", "zmq-tcp", "zmq-ipc", "gloo", "nccl", "nixl")


BACKEND_NAMES = LINK_CHOICES[2:]  # the transport backends an endpoint may host links of
# Whether consumers ask for a checksum of every pulled frame (transfer.transports.checksums):
# off by default, since it lengthened loopback transfers by 10-90% in `kvroute bench transfer`
# (docs/security.md, "Integrity of moved KV"), far above the 5% it may cost to be on.
CHECKSUM_CHOICES = ("on", "off")
DEFAULT_TRANSFER_CHECKSUM = "off"


def transfer_checksum_on(value: str) -> bool:
    """``--transfer-checksum``'s value as a flag; raises ValueError on anything but on/off."""
    if value not in CHECKSUM_CHOICES:
        raise ValueError(f"transfer_checksum must be one of {list(CHECKSUM_CHOICES)}, got {value!r}")
    return value == "on"


def check_transfer_link(value: str) -> None:
    if value not in LINK_CHOICES:
        raise ValueError(f"transfer_link must be one of {list(LINK_CHOICES)}, got {value!r}")


def parse_link_hosts(value: str) -> tuple[str, ...] | None:
    """``--transfer-link-hosts``: comma-separated backend names; empty: None (what
    ``--transfer-link`` implies)."""
    if not value.strip():
        return None
    names = tuple(name.strip() for name in value.split(","))
    unknown = [name for name in names if name not in BACKEND_NAMES]
    if unknown:
        raise ValueError(f"transfer_link_hosts takes backends of {list(BACKEND_NAMES)}, got {unknown}")
    return names
