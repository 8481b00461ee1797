"""The router process: a Ray actor that serves the gRPC API and drives every request across the replicas the
control plane hands it. The actor runs on Ray's asyncio loop; so do the gRPC server and every request."""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.router.lifecycle import DriverSettings, Replica, RequestDriver
from tandem.router.request_parsing import ModelFacts

_log = logging.getLogger(__name__)


def model_id_for(model_path: str | None) -> str:
    """The id clients name the model by: the file or folder name without a quantization suffix."""
    if model_path is None:
        return "SmolLM2-135M-Instruct"
    name = Path(model_path).name
    return name.removesuffix(".gguf").split(".Q")[0] if name.endswith(".gguf") else name


class RouterActor:
    def __init__(self, model_path: str | None, settings: DriverSettings):
        from tandem.engine.loader import load_model

        loaded = load_model(model_path, weights=False, progress=False)
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.model_path = model_path
        self.settings = settings
        self.server = None
        self.servicer = None
        self.endpoint = None

    async def start(self, replicas: list[dict], address: str) -> str:
        """replicas: {name, pool, handle, info} per ready replica. Starts serving on address; returns HOST:PORT."""
        from tandem.router.grpc_service import TandemServicer, start_grpc_server

        prefill = [Replica(r["name"], "prefill", r["handle"], r["info"]) for r in replicas if r["pool"] == "prefill"]
        decode = [Replica(r["name"], "decode", r["handle"], r["info"]) for r in replicas if r["pool"] == "decode"]
        limit = min(r.info["max_model_len"] for r in prefill + decode)
        facts = ModelFacts(model_id_for(self.model_path), self.tokenizer, self.config.vocab_size, limit)
        self.servicer = TandemServicer(RequestDriver(prefill, decode, self.settings), facts, self.settings.mode)
        self.server, port, _ = await start_grpc_server(self.servicer, address)
        self.endpoint = f"{address.rpartition(':')[0]}:{port}"
        return self.endpoint

    async def stats(self) -> dict:
        servicer = self.servicer
        if servicer is None:
            return {"state": "starting"}
        driver = servicer.driver
        return {"state": "serving", "endpoint": self.endpoint, "active_requests": len(servicer.active),
                "queued_requests": driver.num_queued, "finished_requests": servicer.num_finished,
                "failed_requests": servicer.num_failed, "transfer_fallbacks": driver.num_fallbacks,
                "replicas_lost": list(driver.lost),
                "in_flight": {r.name: r.load.in_flight for r in driver.prefill + driver.decode}}

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None
