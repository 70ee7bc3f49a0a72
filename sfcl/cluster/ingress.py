"""The cluster's HTTP entry point: the single server's FastAPI app over an engine in other processes.

``ClusterEngine`` implements ``sfcl.engine.protocol.EngineClient`` over the engine replicas'
``DeploymentHandle``, so ``sfcl.server.create_app`` builds the very app ``sfcl serve`` runs
(same routes, SSE framing, auth, validation, error formats and request log); ``SfclIngress`` is
that app as a Ray Serve ingress deployment (no CPU reserved).

Per request: the prompt is tokenized here (``sfcl.engine.async_engine.encode_chat``, with the
replicas' own tokenizer, fetched once), its KV-block hashes are computed
(``sfcl.engine.block_manager.block_hashes``, what the prefix cache keys by) and passed with the
call, where the router reads them (``sfcl.cluster.router``). Events come back one by one
(``handle.options(stream=True)``). A replica lost before its first event (killed, crashed) is
retried once on another replica; one lost mid-stream ends the stream with an error event. Closing
the stream early (client gone) cancels the call, which aborts the request inside its replica.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError

from sfcl.cluster.replica import Busy
from sfcl.cluster.reports import ReplicaInfo, cluster_health, render_metrics
from sfcl.engine.async_engine import encode_chat
from sfcl.engine.block_manager import block_hashes
from sfcl.engine.events import EngineEvent, ErrorEvent, Finished
from sfcl.engine.protocol import EngineBusyError
from sfcl.engine.request import SamplingParams
from sfcl.engine.token_bound import max_token_chars

log = logging.getLogger("sfcl.cluster")
REPLICA_LOST = "the engine replica serving this request stopped; the response is incomplete"


@dataclass(slots=True)
class IngressSettings:
    api_key: str | None = None  # None: $SFCL_API_KEY of the ingress process, if set
    default_snapshot_mode: str = "triggered"
    router: str = "affinity"  # reported by /health
    ping_interval_s: float = 5.0  # SSE keepalive after this long without an engine event


class ClusterMetrics:
    """``engine.metrics`` of the cluster: the replicas' series, labelled ``replica``."""

    def __init__(self, hub, n_anchors: int):
        self._hub = hub
        self.n_anchors = n_anchors  # read by the built-in dashboard

    async def render(self) -> bytes:
        return render_metrics(await self._hub.collect.remote())


class ClusterEngine:
    """``EngineClient`` over the engine replicas (see the module docstring)."""

    def __init__(self, engine_handle, hub_handle, info: ReplicaInfo, router: str = "affinity"):
        self._handle = engine_handle.options(stream=True)
        self._hub = hub_handle
        self.info = info
        self.router = router
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.snapshots_available = info.snapshots_available
        self.tokenizer = info.tokenizer
        self.max_token_chars = max_token_chars(info.tokenizer)
        self.metrics = ClusterMetrics(hub_handle, info.n_anchors)

    def encode_chat(self, messages: list[dict], system: str | None = None) -> list[int]:
        return encode_chat(self.tokenizer, messages, system)

    def prefix_hashes(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's full-block hashes, as the replicas' prefix caches key them."""
        return block_hashes(prompt_ids, self.info.block_size) if self.info.prefix_caching else []

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[EngineEvent]:
        """Events of the request from the replica the router picks. Raises EngineBusyError before
        the first event when the replica's queue, or the ingress's queue, is full."""
        rid = request_id or uuid.uuid4().hex
        hashes = self.prefix_hashes(prompt_ids)
        for attempt in range(2):
            call = self._handle.stream.remote(prompt_ids, params, rid, prefix_hashes=hashes)
            received = ended = False
            try:
                async for item in call:
                    if isinstance(item, Busy):
                        ended = True
                        raise EngineBusyError(item.retry_after_s)
                    received = True
                    ended = isinstance(item, (Finished, ErrorEvent))
                    yield item
                    if ended:
                        return
                ended = True
                yield ErrorEvent("the engine replica ended the stream without a result", "api_error")
                return
            except BackPressureError:  # the ingress's queue for the replicas is full (max_queued_requests)
                ended = True
                raise EngineBusyError(retry_after_s=1) from None
            except RayActorError as e:
                ended = True
                if not received and attempt == 0:
                    log.warning("replica lost before request %s started (%s); retrying on another", rid, e)
                    continue
                log.warning("replica lost during request %s: %s", rid, e)
                yield ErrorEvent(REPLICA_LOST, "api_error")
                return
            except RayError:
                ended = True
                log.exception("request %s failed in its replica", rid)
                yield ErrorEvent("internal error in the engine replica", "api_error")
                return
            finally:
                if not ended:  # the consumer closed the stream early: abort it in the replica
                    call.cancel()

    async def health(self) -> dict:
        return cluster_health(self.info, await self._hub.collect.remote(metrics=False), self.router)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress()
class SfclIngress:
    """``create_app`` over a ``ClusterEngine``; built after the first engine replica answers."""

    async def __init__(self, engine_handle, hub_handle, settings: IngressSettings):
        info = await engine_handle.describe.remote()
        self.client = ClusterEngine(engine_handle, hub_handle, info, settings.router)
        self.settings = settings

    def __serve_build_asgi_app__(self):
        from sfcl.server.app import create_app

        s = self.settings
        return create_app(self.client, api_key=s.api_key or os.environ.get("SFCL_API_KEY") or None,
                          ping_interval_s=s.ping_interval_s, default_snapshot_mode=s.default_snapshot_mode)
