"""Shared pieces of the KV transfer tests: replicas of agents over random KV, transports by name, waiting, and
one-rank sides in their own processes (ProcessSide, SideProcess)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tandem.engine.attention.kv_quant import convert_blocks
from tandem.engine.kv.kv_cache import KV_STORAGE, KVCacheSpec, PagedKVCache
from tandem.engine.parallel.layout import ParallelConfig, ReplicaLayout
from tandem.kv_transfer.agent import KVTransferAgent
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.descriptor import KVFormat, TransferDescriptor, TransferState
from tandem.kv_transfer.fake_transport import Fabric, FakeTransport

TRANSPORTS = ["fake", "ucx"]


def make_transport(kind: str, fabric: Fabric):
    if kind == "fake":
        return FakeTransport(fabric)
    from tandem.kv_transfer.ucx_transport import UCXTransport

    return UCXTransport("127.0.0.1", 0, TransferConfig().ucx_env)


def nowhere(kind: str) -> str:
    """An address nothing listens at (connections to it are refused)."""
    if kind == "fake":
        return "fake:0"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)


class AgentReplica:
    """One agent per rank of `layout`, each over its own share of a random global KV tensor
    [layers, 2, blocks, KV heads, rows, head_dim] (`whole`, in the stores' dtype: rows are block_size, and one
    more for a quantized store's scales), as a replica's ranks hold it."""

    def __init__(self, layout: ReplicaLayout, *, num_blocks: int, block_size: int, head_dim: int, kind: str,
                 fabric: Fabric, config: TransferConfig = TransferConfig(), seed: int = 0,
                 transport_wrapper=None, clock=time.time, dtype: str = "float32"):
        gen = torch.Generator().manual_seed(seed)
        self.layout = layout
        values = torch.randn(layout.num_layers, 2, num_blocks, layout.num_kv_heads, block_size, head_dim,
                             generator=gen)
        self.whole = convert_blocks(values, block_size, KV_STORAGE[dtype])
        self.agents: list[KVTransferAgent] = []
        for rank in range(layout.world_size):
            shard = layout.shard(rank)
            cache = PagedKVCache(KVCacheSpec(len(shard.layers), num_blocks, block_size, len(shard.kv_heads),
                                             head_dim, KV_STORAGE[dtype]))
            cache.data.copy_(self.whole[shard.layers.start:shard.layers.stop, :, :,
                                        shard.kv_heads.start:shard.kv_heads.stop])
            transport = make_transport(kind, fabric)
            if transport_wrapper is not None:
                transport = transport_wrapper(transport)
            self.agents.append(KVTransferAgent(cache, layout, rank, transport, config, clock=clock))
        self.format = KVFormat(layout.num_layers, layout.num_kv_heads, head_dim, block_size, dtype)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(a.address for a in self.agents)

    def descriptor(self, transfer_id: str, block_ids, num_tokens: int, lease_s: float = 30.0,
                   senders: tuple[str, ...] = (), shared_memory: bool = False) -> TransferDescriptor:
        """Every rank expects the transfer (answering the sending replica's agents at senders, by rank).
        shared_memory: the descriptor names the ranks' shared-memory domains, as a DecodeConnector's do (same-host
        senders then send by reference)."""
        deadline = time.time() + lease_s
        for agent in self.agents:
            agent.expect(transfer_id, block_ids, deadline, senders)
        domains = tuple(a.shared_memory_domain() for a in self.agents) if shared_memory else ()
        return TransferDescriptor(transfer_id, self.layout, tuple(a.address for a in self.agents), tuple(block_ids),
                                  num_tokens, self.format, deadline, domains)

    def holds(self, block_ids, expected: torch.Tensor) -> bool:
        """Every rank's share of block_ids equals its slice of `expected` ([layers, 2, blocks, heads, ...])."""
        rows = torch.tensor(list(block_ids))
        for rank, agent in enumerate(self.agents):
            shard = self.layout.shard(rank)
            mine = agent.kv.data.index_select(2, rows)
            want = expected[shard.layers.start:shard.layers.stop, :, :, shard.kv_heads.start:shard.kv_heads.stop]
            if not torch.equal(mine.view(torch.uint8), want.view(torch.uint8)):  # bit for bit, float8 too
                return False
        return True

    def push(self, dst: AgentReplica, desc: TransferDescriptor, block_ids) -> None:
        """Every rank of this replica sends its share of block_ids (in token order) for desc to dst; returns once
        both sides are DONE."""
        for agent in self.agents:
            agent.arm(desc)
            agent.send_all(desc.transfer_id, block_ids)
        transfer_id = desc.transfer_id
        wait_until(lambda: all(s.state is TransferState.DONE for s in dst.states(transfer_id) +
                               self.states(transfer_id)), what="both sides DONE")

    def states(self, transfer_id: str) -> list:
        return [agent.poll([transfer_id]).get(transfer_id) for agent in self.agents]

    def close(self) -> None:
        for agent in self.agents:
            agent.close()


def layout_of(parallel: ParallelConfig, *, num_layers: int, num_heads: int, num_kv_heads: int,
              num_experts: int = 0) -> ReplicaLayout:
    return ReplicaLayout.build(parallel, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                               num_experts=num_experts)


# -- one single-rank replica's agent in a child process: its KV store on "cpu" or "cuda" ---------------------
# The test process never touches CUDA; each side initialises it in its own spawned process, as ranks do.

@dataclass(frozen=True)
class ProcessSide:
    """What a child side builds: a KV store of random bytes (seeded) on `device`, one UCX agent over it."""

    device: str  # "cpu" | "cuda"
    kv_path: str = "auto"
    dtype: str = "bfloat16"
    seed: int = 0
    num_layers: int = 4
    num_kv_heads: int = 2
    num_blocks: int = 16
    block_size: int = 16
    head_dim: int = 64
    max_message_bytes: int = 64 << 10
    staging_bytes: int = 128 << 10  # room for one message at a time: the pipeline's second copy takes a one-off
    share_kv_store: bool = False  # the store in shared memory: same-host receivers read runs of blocks from it
    secret: bytes = b"tests: both sides of a pair share it"  # what a cluster hands every replica

    def layout(self) -> ReplicaLayout:
        return ReplicaLayout.build(ParallelConfig(), num_layers=self.num_layers, num_heads=2 * self.num_kv_heads,
                                   num_kv_heads=self.num_kv_heads)

    def format(self) -> KVFormat:
        return KVFormat(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)


def run_side(conn, side: ProcessSide) -> None:
    """The child: answers the parent's commands (see SideProcess) until ("stop",). An exception is sent back
    as ("error", traceback) instead of leaving the parent waiting."""
    import traceback

    try:
        from tandem.kv_transfer.agent_factory import AgentFactory

        torch.set_num_threads(1)
        config = TransferConfig(max_message_bytes=side.max_message_bytes, staging_bytes=side.staging_bytes,
                                kv_path=side.kv_path, secret=side.secret, shared_memory=True)
        factory = AgentFactory(config, share_kv_store=side.share_kv_store)
        cache = PagedKVCache(KVCacheSpec(side.num_layers, side.num_blocks, side.block_size, side.num_kv_heads,
                                         side.head_dim, getattr(torch, side.dtype)), side.device,
                             factory.store_memory(torch.device(side.device)))
        gen = torch.Generator().manual_seed(side.seed)
        flat = cache.data.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen).to(cache.data.device))
        agent = factory(0, side.layout(), cache)
        conn.send(("ready", agent.address, agent.stats(), agent.transport.cuda_transports,
                   agent.shared_memory_domain()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        command, *args = conn.recv()
        try:
            if command == "stop":
                agent.close()
                conn.send(("stopped",))
                return
            if command == "expect":  # transfer id, block ids, deadline, senders
                agent.expect(*args)
                conn.send(("ok",))
            elif command == "send_all":  # descriptor, source blocks
                desc, blocks = args
                agent.arm(desc)
                agent.send_all(desc.transfer_id, blocks)
                conn.send(("ok",))
            elif command == "layer_by_layer":  # descriptor, source blocks: as a runner reports computed layers
                desc, blocks = args
                agent.arm(desc, seq_id="seq#0")
                for layer in range(side.num_layers):
                    agent.on_layers_done(layer, {"seq#0": tuple(blocks)})
                conn.send(("ok",))
            elif command == "wait":  # transfer id: until it ended here
                transfer_id = args[0]
                wait_until(lambda: agent.poll([transfer_id])[transfer_id].state.terminal, timeout_s=60,
                           what=f"{transfer_id} to end")
                conn.send(("ended", agent.poll([transfer_id])[transfer_id]))
            elif command == "bytes":  # the whole store's raw bytes [layers, 2, blocks, KV heads, bytes]
                raw = cache.data.cpu().contiguous().view(-1).view(torch.uint8).numpy()
                conn.send(("bytes", raw.reshape(side.num_layers, 2, side.num_blocks, side.num_kv_heads, -1)))
            elif command == "release":  # transfer id: forgotten, every staging slot back
                agent.release(args[0])
                wait_until(lambda: agent.stats().staging_in_use == 0, what="staging slots back")
                agent.check_integrity()
                conn.send(("released", agent.stats()))
            else:
                raise ValueError(f"unknown command {command!r}")
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class SideProcess:
    """The parent's handle on a run_side child (spawned: CUDA starts fresh in it)."""

    def __init__(self, side: ProcessSide, timeout_s: float = 120.0):
        import multiprocessing

        self.timeout_s = timeout_s
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run_side, args=(child, side), daemon=True)
        self.proc.start()
        child.close()
        _, self.address, self.stats, self.cuda_transports, self.shm_domain = self._reply("ready")

    def _reply(self, expected: str) -> tuple:
        if not self.conn.poll(self.timeout_s):
            raise AssertionError(f"no {expected!r} from the side process within {self.timeout_s} s")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise AssertionError(f"the side process failed:\n{reply[1]}")
        assert reply[0] == expected, reply
        return reply

    def ask(self, expected: str, *command) -> tuple:
        self.conn.send(command)
        return self._reply(expected)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.ask("stopped", "stop")
        except (AssertionError, OSError, EOFError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
