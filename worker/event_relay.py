"""KV events leave the worker only under CURVE.

vLLM's publisher binds what it is given, in clear, and its ``BlockStored`` events carry
the prompts' token ids and cache salts. So it binds an ``ipc://`` socket in a folder only
this user can open, and this relay republishes every event on the worker's advertised
KV-events port as a CURVE server (foundation.zmq_auth): orchestrators subscribe there,
the worker's own resident-block follower reads the local socket. Subscriptions flow
upstream through the relay (XPUB/XSUB), so the engine still sends only what someone asked
for.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from pathlib import Path

import zmq

from foundation.zmq_auth import secure_server

logger = logging.getLogger("kvroute.worker.events")


class EventRelay:
    def __init__(self, public_bind_address: str):
        self._folder = Path(tempfile.mkdtemp(prefix="kvroute-events-"))  # 0700
        # Where the engine's publisher binds; short, as ipc paths are limited to ~100 bytes.
        self.local_address = f"ipc://{self._folder}/events"
        self._context = zmq.Context()
        self._upstream = self._context.socket(zmq.XSUB)
        self._upstream.linger = 0
        self._upstream.connect(self.local_address)  # the engine binds later; ZeroMQ retries
        self._public = secure_server(self._context.socket(zmq.XPUB), "worker")
        self._public.linger = 0
        self._public.bind(public_bind_address)
        self._control_address = f"inproc://kvroute-event-relay-{id(self)}"
        self._control = self._context.socket(zmq.PAIR)
        self._control.bind(self._control_address)
        self._thread = threading.Thread(target=self._run, name="kvroute-event-relay", daemon=True)

    def start(self) -> EventRelay:
        self._thread.start()
        logger.info("KV events relayed from %s to %s", self.local_address,
                    self._public.getsockopt_string(zmq.LAST_ENDPOINT))
        return self

    def _run(self) -> None:
        control = self._context.socket(zmq.PAIR)
        control.connect(self._control_address)
        try:
            zmq.proxy_steerable(self._upstream, self._public, None, control)
        except zmq.ContextTerminated:
            pass
        finally:
            control.close(linger=0)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._control.send(b"TERMINATE")
            self._thread.join(timeout=2)
        self._context.destroy(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)
