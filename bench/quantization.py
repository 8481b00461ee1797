"""Quantized weights and KV pages against float32, in one run: accuracy, decode speed, KV capacity, KV transfer.

Modes (weights / compute / KV cache), each against the first, float32, measured in the same run:
  float32            dense float32 weights, float32 KV (the reference and the peer of every ratio)
  bfloat16           dense bfloat16 weights and KV
  int8 weights       per-output-channel int8 projections (bfloat16 compute), bfloat16 KV
  int4 weights       group-wise int4 projections (the GGUF file's Q4 blocks kept; LM head int8), bfloat16 KV
  int8 KV            float32 weights, int8 KV pages (a scale per block and KV head)
  fp8 KV             float32 weights, fp8_e4m3 KV pages
  int8 weights+KV    int8 projections, int8 KV
For each mode, on the embedded SmolLM2-135M-Instruct:
  - perplexity over bench/data/public_domain.txt (~2,900 tokens of public-domain text), fed in 128-token chunks
    through the paged KV cache of the mode's dtype (engine/perplexity.py), and its ratio to float32's;
  - greedy agreement with float32 on the parity prompts (tests/engine/test_parity_embedded.py): for how many
    prompts the first 16 generated tokens are float32's;
  - decode tokens/s at batch 1 (one request, --tokens tokens) and at 64 streams (64 requests at once), counted
    from the step after every request's prefill to the last token (steady-state decode), best of --rounds;
  - KV capacity: tokens a --kv-budget of KV memory holds in the mode's cache dtype (scales included);
  - KV transfer of requests of --transfer-tokens tokens between two KV transfer agents over UCX on loopback
    (gather, MAC, send, receive, verify, scatter; two agents in this process), --transfer-requests of them back to
    back: bytes on the wire per request and seconds per request, median of --rounds; plus bfloat16 pages into an
    int8 store (converted on receive).
The engines run eager (no compiled decode step) unless --compile, so every mode runs the same way.

    .venv/bin/python bench/quantization.py [--tokens 64] [--rounds 3] [--modes "float32,int8 weights"] [--compile]

Targets (issue 26): int8 weights >= 1.6x float32 decode at batch 1; int8 KV transfer <= half of bfloat16's time.
The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.machine, tests' parity prompts
TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
# name: (weight format, compute dtype, KV cache dtype)
MODES = {
    "float32": ("dense", torch.float32, "auto"),
    "bfloat16": ("dense", torch.bfloat16, "auto"),
    "int8 weights": ("int8", torch.bfloat16, "auto"),
    "int4 weights": ("int4", torch.bfloat16, "auto"),
    "int8 KV": ("dense", torch.float32, "int8"),
    "fp8 KV": ("dense", torch.float32, "fp8_e4m3"),
    "int8 weights+KV": ("int8", torch.bfloat16, "int8"),
}
AGREEMENT_TOKENS = 16
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16  # the embedded model's KV shape


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load(mode: str):
    from tandem.engine.loader import load_model

    weights, dtype, _ = MODES[mode]
    return load_model(progress=False, dtype=dtype, weight_format=weights)


def kv_storage(mode: str) -> torch.dtype:
    from tandem.engine.kv.kv_cache import kv_storage_dtype

    _, dtype, kv = MODES[mode]
    return kv_storage_dtype(kv, dtype)


def text_perplexity(loaded, kv_dtype: torch.dtype):
    from tandem.engine.perplexity import perplexity

    return perplexity(loaded.model, loaded.tokenizer.encode(TEXT.read_text()), kv_dtype)


def parity_prompts(tokenizer) -> list[list[int]]:
    from tests.engine.test_parity_embedded import PROMPTS, _prompt_ids

    return [_prompt_ids(tokenizer, PROMPTS[name]) for name in sorted(PROMPTS)]


def greedy_tokens(loaded, kv_cache_dtype: str, prompts: list[list[int]], tokens: int = AGREEMENT_TOKENS
                  ) -> list[list[int]]:
    """Each prompt's first `tokens` greedy tokens, the prompts batched in one engine."""
    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=512, max_model_len=2048, kv_cache_dtype=kv_cache_dtype,
                                            compile=False))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    engine.shutdown()
    return [out[str(i)] for i in range(len(prompts))]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> list[int]:
    """Per prompt: how many leading tokens equal the reference's."""
    return [next((j for j, (a, b) in enumerate(zip(r, t)) if a != b), min(len(r), len(t)))
            for r, t in zip(reference, tokens)]


def decode_rate(loaded, kv_cache_dtype: str, streams: int, tokens: int, compile_step: bool) -> float:
    """Steady-state decode tokens/s of `streams` requests generating `tokens` each (after every prefill)."""
    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.sampling_params import SamplingParams

    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=streams * 8 + 8, max_model_len=128, max_num_seqs=streams,
                                            kv_cache_dtype=kv_cache_dtype, compile=compile_step))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(streams):
        engine.add_request(str(i), loaded.tokenizer.encode(f"Request {i}: tell me about the history of printing."),
                           params)
    started: set[str] = set()
    while len(started) < streams:  # prefill (and the first token) of every request
        started.update(o.request_id for o in engine.step() if o.token_ids)
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(o.token_ids) for o in engine.step())
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return generated / elapsed


def transfer_times(dtypes: list[tuple[str, str]], tokens: int, rounds: int, requests: int = 8) -> dict:
    """For each (sender dtype, receiver dtype): bytes on the wire per request of `tokens` tokens and seconds per
    request, sending `requests` requests back to back between two UCX agents in this process (time from the first
    send to the last acknowledgement, over the requests: what a stream of transfers costs each, with the agents'
    pipelining filled), median of the rounds; the rounds of all pairs interleaved."""
    from tandem.engine.kv.kv_cache import KV_STORAGE, KVCacheSpec, PagedKVCache
    from tandem.engine.parallel.layout import ParallelConfig, ReplicaLayout
    from tandem.kv_transfer.agent import KVTransferAgent
    from tandem.kv_transfer.config import TransferConfig
    from tandem.kv_transfer.descriptor import KVFormat, TransferDescriptor, TransferState
    from tandem.kv_transfer.ucx_transport import UCXTransport

    layout = ReplicaLayout.build(ParallelConfig(), num_layers=LAYERS, num_heads=9, num_kv_heads=KV_HEADS)
    per = -(-tokens // BLOCK)
    config = TransferConfig(staging_bytes=256 << 20)

    def agent(dtype: str) -> KVTransferAgent:
        cache = PagedKVCache(KVCacheSpec(LAYERS, per * requests, BLOCK, KV_HEADS, HEAD_DIM, KV_STORAGE[dtype]))
        if cache.spec.quantized:
            from tandem.engine.attention.kv_quant import convert_blocks

            values = torch.randn(LAYERS, 2, per * requests, KV_HEADS, BLOCK, HEAD_DIM)
            cache.data.view(torch.uint8).copy_(convert_blocks(values, BLOCK, cache.data.dtype).view(torch.uint8))
        else:
            cache.data.normal_()
        return KVTransferAgent(cache, layout, 0, UCXTransport("127.0.0.1", 0, config.ucx_env), config)

    pairs = {pair: (agent(pair[0]), agent(pair[1])) for pair in dtypes}
    times: dict[tuple[str, str], list[float]] = {pair: [] for pair in dtypes}
    moved: dict[tuple[str, str], int] = {}
    try:
        for r in range(rounds + 1):  # the first round warms the connections up, untimed
            for pair, (src, dst) in pairs.items():
                ids = [f"{pair[0]}-{pair[1]}-{r}-{i}" for i in range(requests)]
                blocks = [list(range(i * per, (i + 1) * per)) for i in range(requests)]
                deadline = time.time() + 120
                descs = []
                for transfer_id, own in zip(ids, blocks):
                    dst.expect(transfer_id, own, deadline, (src.address,))
                    descs.append(TransferDescriptor(transfer_id, layout, (dst.address,), tuple(own), tokens,
                                                    KVFormat(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, pair[1]), deadline))
                start = time.perf_counter()
                for desc, own in zip(descs, blocks):
                    src.arm(desc)
                    src.send_all(desc.transfer_id, own)
                statuses = dst.poll(ids)
                while not all(s.state.terminal for s in statuses.values()):
                    time.sleep(0.0001)
                    statuses = dst.poll(ids)
                elapsed = time.perf_counter() - start
                for transfer_id, status in statuses.items():
                    if status.state is not TransferState.DONE:
                        raise RuntimeError(f"transfer {transfer_id} ended {status.state.value}: {status.error}")
                while not all(s.state.terminal for s in src.poll(ids).values()):
                    time.sleep(0.0001)
                if r:
                    times[pair].append(elapsed / requests)
                moved[pair] = statuses[ids[0]].nbytes
                for transfer_id in ids:
                    src.release(transfer_id)
                    dst.release(transfer_id)
    finally:
        for src, dst in pairs.values():
            src.close()
            dst.close()
    return {f"{a}->{b}": {"bytes": moved[(a, b)], "seconds": statistics.median(times[(a, b)])} for a, b in dtypes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated names of MODES")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each request decodes")
    parser.add_argument("--streams", type=int, default=64, help="concurrent requests of the batched decode")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-budget", type=int, default=1 << 30, help="KV bytes for the capacity column")
    parser.add_argument("--transfer-tokens", type=int, default=1024)
    parser.add_argument("--transfer-requests", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="run the compiled decode step (default eager)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from bench.machine import cpu_report, machine_line  # noqa: E402 - after the path insert
    from tandem.engine.kv.kv_cache import KVCacheSpec, kv_dtype_name

    modes = [m.strip() for m in args.modes.split(",")]
    if modes[0] != "float32":
        modes.insert(0, "float32")  # the peer of every ratio
    results: dict[str, dict] = {}
    reference_tokens = None
    for mode in modes:
        log(f"{mode}: loading")
        loaded = load(mode)
        kv_dtype = kv_storage(mode)
        row: dict = {"weights": MODES[mode][0], "compute": str(MODES[mode][1]).removeprefix("torch."),
                     "kv_cache": kv_dtype_name(kv_dtype)}
        ppl = text_perplexity(loaded, kv_dtype)
        row["perplexity"] = round(ppl.value, 4)
        row["perplexity_tokens"] = ppl.num_tokens
        tokens = greedy_tokens(loaded, MODES[mode][2], parity_prompts(loaded.tokenizer))
        if reference_tokens is None:
            reference_tokens = tokens
        agreed = agreement(reference_tokens, tokens)
        row["agree_16_of_prompts"] = f"{sum(a >= AGREEMENT_TOKENS for a in agreed)}/{len(agreed)}"
        row["agreed_tokens"] = agreed
        for streams, key in ((1, "decode_b1_tok_s"), (args.streams, f"decode_b{args.streams}_tok_s")):
            rates = [decode_rate(loaded, MODES[mode][2], streams, args.tokens, args.compile)
                     for _ in range(args.rounds)]
            row[key] = round(max(rates), 2)
        spec = KVCacheSpec(LAYERS, 1, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype)
        row["kv_capacity_tokens"] = args.kv_budget // spec.bytes_per_block * BLOCK
        results[mode] = row
        log(f"{mode}: {json.dumps(row)}")
        del loaded
    base = results["float32"]
    for row in results.values():
        row["perplexity_ratio"] = round(row["perplexity"] / base["perplexity"], 4)
        row["decode_b1_speedup"] = round(row["decode_b1_tok_s"] / base["decode_b1_tok_s"], 2)
        key = f"decode_b{args.streams}_tok_s"
        row[f"decode_b{args.streams}_speedup"] = round(row[key] / base[key], 2)
        row["kv_capacity_ratio"] = round(row["kv_capacity_tokens"] / base["kv_capacity_tokens"], 2)
    log("KV transfer")
    pairs = [("float32", "float32"), ("bfloat16", "bfloat16"), ("int8", "int8"), ("fp8_e4m3", "fp8_e4m3"),
             ("bfloat16", "int8")]
    transfer = transfer_times(pairs, args.transfer_tokens, args.rounds, args.transfer_requests)
    for row in transfer.values():
        row["bytes_ratio_vs_float32"] = round(row["bytes"] / transfer["float32->float32"]["bytes"], 3)
        row["time_ratio_vs_float32"] = round(row["seconds"] / transfer["float32->float32"]["seconds"], 3)
        row["time_ratio_vs_bfloat16"] = round(row["seconds"] / transfer["bfloat16->bfloat16"]["seconds"], 3)
    summary = {
        "int8_weights_b1_speedup": results.get("int8 weights", {}).get("decode_b1_speedup"),
        "int8_kv_transfer_time_vs_bf16": transfer["int8->int8"]["time_ratio_vs_bfloat16"],
        "int8_kv_transfer_bytes_vs_bf16": round(transfer["int8->int8"]["bytes"] /
                                                transfer["bfloat16->bfloat16"]["bytes"], 3),
    }
    print(json.dumps({"machine": machine_line(), "cpu": cpu_report(), "threads": args.threads,
                      "compiled": args.compile, "tokens": args.tokens, "streams": args.streams,
                      "transfer_tokens": args.transfer_tokens, "transfer_requests": args.transfer_requests,
                      "modes": results, "transfer": transfer,
                      "summary": summary}))


if __name__ == "__main__":
    main()
