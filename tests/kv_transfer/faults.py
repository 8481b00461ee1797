"""Fault injection for transfer tests: a transport wrapper that corrupts, drops or swallows messages, and an
engine pair (prefill + decode, one process each side's agent) driven step by step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.agent import KVTransferAgent
from tandem.kv_transfer.agent_factory import AgentFactory
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.connector import HOLD_GRACE_S, DecodeConnector, PrefillConnector, first_token_of
from tandem.kv_transfer.descriptor import TransferState
from tandem.kv_transfer.fake_transport import Fabric
from tandem.kv_transfer.transport import Completed
from tandem.kv_transfer.wire import Kind, split_tag
from tests.kv_transfer.kv_helpers import make_transport, wait_until


class FaultyTransport:
    """Passes everything to `inner` except: the next `corrupt` DATA messages get one payload byte flipped; the
    DATA message number `drop_at` (0-based, counted from now) closes the connection right after it is posted
    and reports the send failed; with swallow_acks, ACKs are never sent. fault_every = N (vLLM's UCX injector
    fails every 16th operation): every Nth send of any kind is hit, in turn corrupted (its last byte flipped:
    a DATA payload, a status message's MAC), failed (the connection closed, the send reported failed) and
    lost (reported sent, never delivered); `injected` counts them by how."""

    def __init__(self, inner):
        self.inner = inner
        self.corrupt = 0
        self.drop_at: int | None = None
        self.swallow_acks = False
        self.data_sent = 0
        self.fault_every: int | None = None
        self.sends = 0
        self.injected = {"corrupted": 0, "failed": 0, "lost": 0}

    def _injected_fault(self, peer, buffer):
        """(buffer to send, or a Completed to return instead) for the send fault_every picks."""
        how = ("corrupted", "failed", "lost")[sum(self.injected.values()) % 3]
        self.injected[how] += 1
        if how == "corrupted":
            buffer = buffer.copy()
            buffer[-1] ^= 0x40
            return buffer
        if how == "failed":
            self.inner.forget_peer(peer)
            return Completed("injected fault: the connection dropped")
        return Completed()

    @property
    def address(self) -> str:
        return self.inner.address

    @property
    def device_transports(self) -> tuple[str, ...]:
        return self.inner.device_transports

    def send(self, peer, tag, buffer):
        self.sends += 1
        if self.fault_every and self.sends % self.fault_every == 0:
            hit = self._injected_fault(peer, buffer)
            if isinstance(hit, Completed):
                return hit
            buffer = hit
        kind = split_tag(tag)[1]
        if kind is Kind.ACK and self.swallow_acks:
            return Completed()  # "sent", never delivered
        if kind is Kind.DATA:
            index, self.data_sent = self.data_sent, self.data_sent + 1
            if self.corrupt:
                self.corrupt -= 1
                buffer = buffer.copy()
                buffer[-1] ^= 0x40
            if self.drop_at == index:  # the connection goes down: this message is lost, the ones before it cut
                self.drop_at = None
                self.inner.forget_peer(peer)
                return Completed("connection dropped")
        return self.inner.send(peer, tag, buffer)

    def probe(self, tag, mask):
        return self.inner.probe(tag, mask)

    def receive(self, probe, buffer):
        return self.inner.receive(probe, buffer)

    def forget_peer(self, peer, handle=None):
        self.inner.forget_peer(peer, handle)

    def close(self):
        self.inner.close()


class LayerTap:
    """Stands between a runner and its agent: calls `on_layer(layer)` before passing each layer on, and stops
    passing layers on once `cut` is set (a sender that died mid-prefill). Taps the agent from construction
    (its on_layers_done, which the runner calls) until remove()."""

    def __init__(self, agent, on_layer):
        self.agent, self.on_layer, self.cut = agent, on_layer, False
        self._passed = agent.on_layers_done
        agent.on_layers_done = self.on_layers_done

    def on_layers_done(self, layer, tables):
        self.on_layer(layer)
        if not self.cut:
            self._passed(layer, tables)

    def remove(self) -> None:
        del self.agent.on_layers_done  # the agent's own method again


@dataclass
class Side:
    engine: LLMEngine
    agent: KVTransferAgent
    transport: FaultyTransport
    events: dict = field(default_factory=dict)  # request id -> last TransferEvent


class _SideFactory:
    """Builds a side's agent over a FaultyTransport (kept in `made`); the prefill side's KV store is shared
    memory (same-host receivers read its blocks directly), as a prefill replica's is."""

    def __init__(self, pair: EnginePair, share_kv_store: bool):
        self.pair, self.share_kv_store, self.made = pair, share_kv_store, {}

    def store_memory(self, device):
        return AgentFactory(self.pair.config, self.pair.fabric, self.share_kv_store).store_memory(device)

    def __call__(self, rank, layout, cache):
        self.made["transport"] = FaultyTransport(make_transport(self.pair.kind, self.pair.fabric))
        self.made["agent"] = KVTransferAgent(cache, layout, rank, self.made["transport"], self.pair.config)
        return self.made["agent"]


class EnginePair:
    """A prefill and a decode engine on one model, each with one agent over `kind`, plus their connectors. The
    prefill side's KV store is shared (its contiguous runs of blocks go by reference from the store itself)."""

    def __init__(self, loaded, kind: str, *, lease_s: float = 20.0, fabric: Fabric | None = None):
        self.loaded, self.kind, self.fabric = loaded, kind, fabric or Fabric()
        # same-host by reference with the fake transport; over UCX in this process, through the transport (one
        # full-suite run crashed with both by-reference agents over UCX in one process: issue 23 note)
        self.config = TransferConfig(transport=kind, lease_s=lease_s, max_message_bytes=1 << 20,
                                     shared_memory=kind == "fake",
                                     staging_bytes=4 << 20)
        self.prefill_clock_offset = 0.0  # what assert_clean adds to the prefill connector's clock, for a moment
        self.prefill = self.new_side(share_kv_store=True)
        self.decode = self.new_side()
        self.pc = self.prefill_connector()
        self.dc = DecodeConnector(self.decode.engine, self.config)
        self.first: dict[str, object] = {}

    def prefill_connector(self) -> PrefillConnector:
        return PrefillConnector(self.prefill.engine, clock=lambda: time.time() + self.prefill_clock_offset)

    def new_side(self, share_kv_store: bool = False) -> Side:
        factory = _SideFactory(self, share_kv_store)
        engine = LLMEngine(self.loaded, EngineConfig(num_kv_blocks=24, check_integrity=True), kv_agent=factory)
        return Side(engine, factory.made["agent"], factory.made["transport"])

    def replace_prefill(self) -> None:
        self.prefill.engine.shutdown()
        self.prefill = self.new_side(share_kv_store=True)
        self.pc = self.prefill_connector()

    def replace_decode(self) -> None:
        self.decode.engine.shutdown()
        self.decode = self.new_side()
        self.dc = DecodeConnector(self.decode.engine, self.config)

    def run_prefill(self) -> None:
        while self.prefill.engine.has_unfinished_requests():
            for out in self.prefill.engine.step():
                if out.token_ids:
                    self.first[out.request_id] = first_token_of(out)

    def poll(self) -> None:
        for side, connector in ((self.prefill, self.pc), (self.decode, self.dc)):
            for event in connector.poll():
                side.events[event.request_id] = event

    def settle(self, request_id: str, timeout_s: float = 30.0) -> tuple[TransferState | None, TransferState | None]:
        """Polls until neither side's transfer is running; returns (prefill, decode) last reported states."""
        def ended():
            self.poll()
            running = [c.state(request_id) for c in (self.pc, self.dc)]
            return all(s is None or s.terminal for s in running)

        wait_until(ended, timeout_s, what=f"both sides of {request_id} to end")
        return tuple(side.events[request_id].state if request_id in side.events else None
                     for side in (self.prefill, self.decode))

    def reserve(self, request_id: str, prompt, params: SamplingParams, **kwargs):
        """The decode connector's reserve, naming the prefill side's agents as the senders (as the router does)."""
        return self.dc.reserve(request_id, prompt, params, senders=self.pc.addresses, **kwargs)

    def decode_rest(self, request_id: str) -> list[int]:
        tokens = list(self.dc.admit(request_id, self.first[request_id])[0].token_ids)
        while self.decode.engine.has_unfinished_requests():
            for out in self.decode.engine.step():
                tokens.extend(out.token_ids)
        return tokens

    def transfer(self, request_id: str, prompt, params: SamplingParams) -> list[int]:
        """A whole disaggregated request that must succeed; returns its output tokens."""
        desc = self.reserve(request_id, prompt, params)
        self.pc.submit(request_id, prompt, params, desc)
        self.run_prefill()
        assert self.settle(request_id) == (TransferState.DONE, TransferState.DONE)
        return self.decode_rest(request_id)

    def assert_clean(self) -> None:
        """No KV block held on either side once everything ended (the prefill side's blocks held for a transfer
        that failed are let go: its connector is polled as if the lease and the grace had passed); pools and
        agents consistent."""
        assert self.pc.holds == self.prefill.agent.shares_kv_store() == self.config.shared_memory
        self.prefill_clock_offset = self.config.lease_s + HOLD_GRACE_S + 1
        try:
            self.pc.poll()
        finally:
            self.prefill_clock_offset = 0.0
        assert self.prefill.engine.scheduler.kv.num_holds == 0
        for name, side in (("prefill", self.prefill), ("decode", self.decode)):
            wait_until(lambda: side.engine.stats().num_blocks_in_use == 0, what=f"{name} blocks to be freed")
            side.engine.check_integrity()
            wait_until(lambda: side.agent.stats().staging_in_use == 0,
                       what=f"{name} staging slots back ({side.agent.stats()})")
            side.agent.check_integrity()

    def close(self) -> None:
        self.prefill.engine.shutdown()
        self.decode.engine.shutdown()


# -- a side in its own process, killed with SIGKILL (a real death: the kernel resets its connections) --------

def _child_side(conn, role: str, model_path: str, secret: bytes) -> None:
    """Runs one side with a UCX agent under the parent's transfer secret. decode: reserves for the prompt it is
    sent (answering the senders it is sent), answers with the descriptor and waits to be killed. prefill: pushes into the descriptor it is sent and kills itself when layer 1 of the
    prompt is computed (layer 0 is on the wire)."""
    import os
    import signal

    import torch

    from tandem.engine.loader import load_model
    from tandem.kv_transfer.agent_factory import AgentFactory

    torch.set_num_threads(1)
    config = TransferConfig(max_message_bytes=1 << 20, staging_bytes=4 << 20, secret=secret)
    engine = LLMEngine(load_model(model_path, progress=False), EngineConfig(num_kv_blocks=24),
                       kv_agent=AgentFactory(config))
    if role == "decode":
        dc = DecodeConnector(engine, config)
        prompt, params, lease_s, senders = conn.recv()
        conn.send(dc.reserve("r", prompt, params, lease_s=lease_s, senders=senders))
        conn.recv()  # never comes: the parent kills this process
        return
    agent = engine.executor.agent

    def die_at_layer_1(layer):
        if layer == 1:
            time.sleep(0.2)  # layer 0 reaches the peer first
            os.kill(os.getpid(), signal.SIGKILL)
    LayerTap(agent, die_at_layer_1)
    prompt, params, desc = conn.recv()
    PrefillConnector(engine).submit("r", prompt, params, desc)
    conn.send("submitted")
    engine.step()


def start_child_side(role: str, model_path: str, secret: bytes):
    """(process, connection) of a side started by _child_side."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_side, args=(child, role, model_path, secret), daemon=True)
    proc.start()
    child.close()
    return proc, parent
