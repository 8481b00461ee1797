"""Whole replicas of different layouts, each rank in its own process with its own UCX agent: a prefill replica
computes prompts, its ranks push the KV to the decode replica's ranks as each layer is computed (re-sharding
between the layouts), and the decode replica continues the requests. Each destination rank's KV equals the
source ranks' bytes, and the greedy tokens equal a single-process run."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.loader import load_model
from tandem.engine.parallel import ParallelConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.agent_factory import AgentFactory
from tandem.kv_transfer.config import TransferConfig
from tandem.kv_transfer.connector import DecodeConnector, PrefillConnector, first_token_of
from tandem.kv_transfer.descriptor import TransferState
from tandem.kv_transfer.replica_agents import ReplicaAgents
from tests.engine.tiny_models import write_tiny_model
from tests.kv_transfer.kv_helpers import wait_until

TEXTS = ["The capital of France is", "Once upon a time, there was a little robot who lived in a small town by"]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CONFIG = EngineConfig(num_kv_blocks=32)
TRANSFER = TransferConfig(layer_group=1, max_message_bytes=1 << 20, staging_bytes=8 << 20, shared_memory=True)


@pytest.fixture(scope="module")
def models(embedded, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-mixtral")
    write_tiny_model(folder, "mixtral", embedded.tokenizer)
    return {"smollm2": None, "mixtral": str(folder)}


def single_process(path, prompts) -> list[list[int]]:
    engine = LLMEngine(load_model(path, progress=False), CONFIG)
    outputs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, PARAMS)
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.token_ids)
        outputs.append(tokens)
    return outputs


def replica(path, parallel: ParallelConfig, share_kv_store: bool = False) -> LLMEngine:
    """share_kv_store: each rank's KV store in shared memory, as a prefill replica's (same-host decode ranks
    read runs of blocks from it directly)."""
    loaded = load_model(path, weights=parallel.world_size == 1, progress=False)
    return LLMEngine(loaded, CONFIG, parallel=parallel, kv_agent=AgentFactory(TRANSFER, share_kv_store=share_kv_store))


def whole_kv(engine: LLMEngine, transfer_blocks: dict[int, tuple[int, ...]]) -> np.ndarray:
    """The replica's KV of the given blocks (per rank: the blocks that rank read or wrote), assembled from
    every rank's share into [layers, 2, blocks, KV heads, block_size, head_dim]."""
    layout, spec = engine.layout, engine.kv_cache_spec
    shares = ReplicaAgents(engine).read_kv(transfer_blocks)
    nb = len(next(iter(transfer_blocks.values())))
    out = np.full((layout.num_layers, 2, nb, layout.num_kv_heads, spec.block_size, spec.head_dim), np.nan,
                  dtype=np.float32)
    for rank, share in shares.items():
        shard = layout.shard(rank)
        region = out[shard.layers.start:shard.layers.stop, :, :, shard.kv_heads.start:shard.kv_heads.stop]
        held = ~np.isnan(region)
        assert np.array_equal(region[held], share[held]), f"rank {rank} disagrees with a replica of its KV"
        region[...] = share
    assert not np.isnan(out).any()
    return out


@pytest.mark.parametrize("model, src, dst", [  # tp=2 -> pp=2 is tp=3 -> pp=2's even twin: a slow variant
    pytest.param("smollm2", ParallelConfig(tp=2), ParallelConfig(pp=2), marks=pytest.mark.slow),
    ("smollm2", ParallelConfig(tp=3), ParallelConfig(pp=2, tp=1)),
    ("mixtral", ParallelConfig(tp=1), ParallelConfig(ep=2, pp=2)),
], ids=["smollm2-tp2-to-pp2", "smollm2-tp3-to-pp2", "mixtral-tp1-to-ep2xpp2"])
def test_prefill_and_decode_replicas_of_different_layouts(models, embedded, model, src, dst):
    path = models[model]
    prompts = [embedded.tokenizer.encode(t) for t in TEXTS]
    want = single_process(path, prompts)
    with replica(path, src, share_kv_store=True) as prefill, replica(path, dst) as decode:
        pc, dc = PrefillConnector(prefill), DecodeConnector(decode, TRANSFER)
        descs = []
        for i, prompt in enumerate(prompts):  # both prompts complete in the same prefill step
            descs.append(dc.reserve(str(i), prompt, PARAMS, senders=pc.addresses))
            pc.submit(str(i), prompt, PARAMS, descs[-1])
        first = {}
        while prefill.has_unfinished_requests():
            for out in prefill.step():
                first[out.request_id] = first_token_of(out)
        sources = {i: pc.agents.source_blocks(d.transfer_id) for i, d in enumerate(descs)}

        def all_done():
            pc.poll()
            dc.poll()
            return all(dc.state(str(i)) is TransferState.DONE for i in range(len(prompts))) and \
                all(pc.state(str(i)) is None for i in range(len(prompts)))
        wait_until(all_done, timeout_s=60, what="every transfer to finish")
        for i, desc in enumerate(descs):
            sent_from = {r: b for r, b in sources[i].items() if b}  # ranks a plan left idle sent nothing
            source = whole_kv(prefill, {r: sent_from.get(r, next(iter(sent_from.values())))
                                        for r in range(prefill.layout.world_size)})
            arrived = whole_kv(decode, {r: desc.block_ids for r in range(decode.layout.world_size)})
            assert np.array_equal(source, arrived), f"request {i}: KV differs after the transfer"
        got = []
        for i in range(len(prompts)):
            got.append(list(dc.admit(str(i), first[str(i)])[0].token_ids))
        while decode.has_unfinished_requests():
            for out in decode.step():
                got[int(out.request_id)].extend(out.token_ids)
        assert got == want
        sent = pc.agents.stats().values()
        assert sum(s.from_store for s in sent) > 0 and all(s.shared_memory == "on" for s in sent)
        for engine in (prefill, decode):
            assert engine.stats().num_blocks_in_use == 0
            engine.check_integrity()
