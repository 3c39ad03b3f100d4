"""The names ``--transfer-link`` accepts, importable without torch or ZeroMQ."""

ENDPOINT = "endpoint"  # no link: the layers come back on the connection that asked for them
LINK_CHOICES = (ENDPOINT, "auto", "zmq-tcp", "zmq-ipc", "gloo", "nccl")
