"""Transports: moving a transfer's per-layer frames over one link, whatever the wire.

* ``base``: the interface (``Sender.send``, ``Receiver.receive``) and its one template;
* ``links``: first contact over a caller's control channel, and one link per peer;
* ``handshake``: layouts exchanged and compared, the sender's address announced;
* ``selection``: which backend a link uses, automatic or forced;
* backends: ``zmq_backend`` (tcp, ipc), ``distributed`` (Gloo, NCCL), ``nixl_backend``
  (NIXL one-sided READs; with ``nixl_agent`` and ``nixl_buffers``), ``fake`` (tests).
"""
