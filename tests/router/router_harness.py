"""What the router tests that start real servers over mock replicas share: the embedded model's tokenizer and
config (loaded once per process, no weights) and an event loop on a background thread for the servers."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Coroutine, TypeVar

from tandem.engine.loader import load_model
from tandem.router.request_parsing import ModelFacts

MODEL = "SmolLM2-135M-Instruct"
T = TypeVar("T")


@functools.lru_cache(maxsize=1)
def embedded():
    return load_model(None, weights=False, progress=False)


def model_facts(max_model_len: int = 512) -> ModelFacts:
    loaded = embedded()
    return ModelFacts(MODEL, loaded.tokenizer, loaded.config.vocab_size, max_model_len)


class BackgroundLoop:
    """An asyncio loop running on its own daemon thread; run() waits for a coroutine on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[object, object, T], timeout_s: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
