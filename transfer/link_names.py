"""The names ``--transfer-link`` accepts, importable without torch or ZeroMQ."""

ENDPOINT = "endpoint"  # no link: the layers come back on the connection that asked for them
LINK_CHOICES = (ENDPOINT, "auto", "zmq-tcp", "zmq-ipc", "gloo", "nccl")


def check_transfer_link(value: str) -> None:
    if value not in LINK_CHOICES:
        raise ValueError(f"transfer_link must be one of {list(LINK_CHOICES)}, got {value!r}")
