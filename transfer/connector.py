"""``KVRouteConnector``: kvroute's vLLM KV connector, loaded by module path.

vLLM builds one instance per role: in the engine-core process (SCHEDULER role) and in
each model-worker process (WORKER role). Each instance delegates to the half that
does that role's work; the halves talk only through ``KVRouteConnectorMetadata``.

Load it with::

    kv_transfer_config = {
        "kv_connector": "KVRouteConnector",
        "kv_connector_module_path": "transfer.connector",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"transfer_address": ..., "transfer_bind": ...},
    }
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from foundation import zmq_auth
from foundation.log_setup import show_kvroute_logs
from transfer.connector_scheduler import ConnectorScheduler
from transfer.connector_worker import ConnectorWorker
from transfer.metadata import KVRouteConnectorMetadata
from transfer.settings import ConnectorSettings

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput


class KVRouteConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        show_kvroute_logs()  # vLLM's engine processes: kvroute's lines reach the worker's log
        settings = ConnectorSettings.from_extra_config(
            dict(self._kv_transfer_config.kv_connector_extra_config))
        # The engine's own process: it speaks on the transfer endpoint, so it needs the keys.
        zmq_auth.configure_from_flags(settings.cluster_keys, settings.insecure_no_auth, "worker",
                                      settings.transfer_encryption)
        block_size = vllm_config.cache_config.block_size
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(settings, block_size)
        else:
            self._worker = ConnectorWorker(settings, kv_cache_config.num_blocks, block_size)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Grants, pulls and releases start here, before the step's forward pass.

        vLLM calls ``start_load_kv`` for asynchronous loads only *after* the forward, and
        on CPU the forward is the whole step: a producer busy with a long prefill chunk
        would make every consumer wait that long for the lease of a request that had
        already finished (and its first token already gone out), long enough for parked
        pulls to be refused and the leases to expire unpulled."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, KVRouteConnectorMetadata)
            self._worker.start(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Loads were started in ``bind_connector_metadata``."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and finish before vLLM schedules the request."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Producers serve blocks straight from the paged cache; nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing is saved asynchronously (see ``save_kv_layer``)."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, receiving, failed = self._worker.take_results()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=receiving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output.total_num_scheduled_tokens)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        if connector_output.failed_recving:
            self._scheduler.loads_failed(set(connector_output.failed_recving))
        if connector_output.finished_recving:
            self._scheduler.loads_done(set(connector_output.finished_recving))
