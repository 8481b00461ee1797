"""Structured output: the grammar library chosen by measurement, and what constraints cost the engine, in one run.

1. Libraries (llguidance, which tandem uses, against xgrammar when it is installed: `make bench-peers`), on the
   embedded model's 49,152-token vocabulary and the test suite's constraints (tests/engine/structured_cases.py:
   30 JSON schemas, 2 unbounded ones, 10 regexes): how many each compiles, compile time per constraint (cold: a
   fresh compiler, no cache), and the time to fill one next-token mask, per token, while replaying the same
   outputs (tandem's greedy constrained output of each case) through each library's matcher. Install weight: the
   size on disk of each library and of what it pulls in that tandem would not have otherwise.
2. The engine: decode steps of a batch of --batch sequences (and of one), constrained (a JSON schema whose
   outputs run longer than the measured steps) against the same requests unconstrained, interleaved rounds;
   mask filling runs on a helper thread during the forward pass (engine/runner/model_runner.py).

    .venv/bin/python bench/structured_output.py [--batch 64] [--steps 32] [--rounds 3] [--threads 2] [--device cuda]

The last line of output is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.compiled_step import step_times  # noqa: E402
from bench.machine import cpu_report, embedded_on, machine_line  # noqa: E402

# Outputs longer than any measured run: an array of at least 40 short objects.
LONG_SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 40, "maxItems": 60, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "n"], "additionalProperties": False}}}, "required": ["rows"], "additionalProperties": False}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _dist_size(name: str) -> int:
    """Bytes on disk of an installed distribution's files."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return 0
    return sum(Path(dist.locate_file(f)).stat().st_size for f in dist.files or () if Path(dist.locate_file(f)).is_file())


def cases():
    from tests.engine.structured_cases import REGEXES, SCHEMAS, UNBOUNDED, prompt_for_regex, prompt_for_schema

    out = [("json", name, schema, prompt_for_schema(name)) for name, schema in {**SCHEMAS, **UNBOUNDED}.items()]
    return out + [("regex", name, pattern, prompt_for_regex(name)) for name, pattern in REGEXES.items()]


def reference_outputs(loaded, engine_cls, config) -> dict[str, list[int]]:
    """tandem's greedy constrained output of every case (64 tokens at most), the tokens both libraries replay."""
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.structured_output import StructuredOutput

    outputs: dict[str, list[int]] = {}
    with engine_cls(loaded, config) as engine:
        for kind, name, value, prompt in cases():
            spec = StructuredOutput.json_schema(value) if kind == "json" else StructuredOutput.regex(value)
            engine.add_request(f"{kind}-{name}", loaded.tokenizer.encode_chat([{"role": "user", "content": prompt}]),
                               SamplingParams(max_tokens=64, temperature=0, structured=spec))
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
    return outputs


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int):
        from tandem.engine.decoding.grammar import GrammarBackend

        self.backend = GrammarBackend(tokenizer, vocab)
        self.vocab = vocab
        from tandem.engine.structured_output import StructuredOutput

        self.backend.compile(StructuredOutput.regex("x"))  # builds the token tables (timed as setup)

    def compile(self, kind: str, value):
        from tandem.engine.structured_output import StructuredOutput

        self.backend._cache.clear()  # cold: no cached grammar
        spec = StructuredOutput.json_schema(value) if kind == "json" else StructuredOutput.regex(value)
        return self.backend.compile(spec)

    def replay(self, compiled, tokens: list[int]) -> tuple[list[float], bool]:
        from tandem.engine.decoding.grammar_masks import allocate_bitmask, fill_masks

        matcher, mask, times = compiled.matcher(), allocate_bitmask(1, self.vocab), []
        for t in tokens:
            start = time.perf_counter()
            fill_masks(self.backend, [(matcher, 0)], mask)
            times.append(time.perf_counter() - start)
            if not matcher.accept(t):
                return times, False
        return times, True


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                                            stop_token_ids=list(tokenizer.eos_token_ids))
        self.vocab = vocab

    def compile(self, kind: str, value):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":  # the same JSON text tandem's grammar allows: ", " and ": ", no other whitespace
            return compiler.compile_json_schema(json.dumps(value), any_whitespace=False, separators=(", ", ": "))
        return compiler.compile_regex(value)

    def replay(self, compiled, tokens: list[int]) -> tuple[list[float], bool]:
        matcher = self.xgr.GrammarMatcher(compiled)
        mask, times = self.xgr.allocate_token_bitmask(1, self.vocab), []
        for t in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - start)
            if not matcher.accept_token(t):
                return times, False
        return times, True


def compare_libraries(loaded, outputs: dict[str, list[int]]) -> dict:
    libraries = [Llguidance]
    try:
        import xgrammar  # noqa: F401

        libraries.append(Xgrammar)
    except ImportError:
        print("xgrammar is not installed (make bench-peers): measuring llguidance alone", file=sys.stderr)
    results = {}
    for cls in libraries:
        start = time.perf_counter()
        lib = cls(loaded.tokenizer, loaded.config.vocab_size)
        setup_s = time.perf_counter() - start
        compiled, failed, compile_ms, mask_us, replayed, rejected = 0, {}, [], [], 0, []
        for kind, name, value, _ in cases():
            try:
                start = time.perf_counter()
                grammar = lib.compile(kind, value)
                compile_ms.append((time.perf_counter() - start) * 1e3)
                compiled += 1
            except Exception as e:  # noqa: BLE001 - a constraint a library cannot compile is a result
                failed[f"{kind}-{name}"] = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
                continue
            times, ok = lib.replay(grammar, outputs.get(f"{kind}-{name}", []))
            mask_us += [t * 1e6 for t in times]
            replayed += ok
            if not ok:
                rejected.append(f"{kind}-{name}")
        results[cls.name] = {
            "tokenizer_setup_s": round(setup_s, 3), "compiled": compiled, "cases": len(cases()), "failed": failed,
            "compile_ms": {"p50": round(statistics.median(compile_ms), 3), "p99": round(_percentile(compile_ms, 0.99), 3),
                           "max": round(max(compile_ms), 3)},
            "mask_us_per_token": {"p50": round(statistics.median(mask_us), 1),
                                  "p99": round(_percentile(mask_us, 0.99), 1), "tokens": len(mask_us)},
            "outputs_replayed": replayed, "outputs_rejected": rejected}
        print(f"{cls.name}: compiled {compiled}/{len(cases())}, compile p50 {results[cls.name]['compile_ms']['p50']} "
              f"ms, mask p50/p99 {results[cls.name]['mask_us_per_token']['p50']}/"
              f"{results[cls.name]['mask_us_per_token']['p99']} us per token", file=sys.stderr)
    weight = {"llguidance": {"own_mb": round(_dist_size("llguidance") / 1e6, 1), "pulls_in": []},
              "xgrammar": {"own_mb": round(_dist_size("xgrammar") / 1e6, 1),
                           "pulls_in": ["apache-tvm-ffi", "torch", "transformers", "triton", "pydantic", "numpy"],
                           "new_to_tandem_mb": round(_dist_size("apache-tvm-ffi") / 1e6, 1)}}
    return {"libraries": results, "install": weight}


def step_overhead(loaded, engine_cls, config_cls, batch: int, steps: int, rounds: int) -> dict:
    """ms per decode step of `batch` sequences constrained against unconstrained (ignore_eos, same lengths)."""
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.structured_output import StructuredOutput

    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": f"List {40 + i} rows as JSON."}])
               for i in range(batch)]
    spec = StructuredOutput.json_schema(LONG_SCHEMA)
    config = config_cls(num_kv_blocks=4096, max_num_seqs=max(batch, 1), compile=False, enable_prefix_caching=False)

    def run(engine, constrained: bool) -> float:
        params = SamplingParams(max_tokens=steps + 2, temperature=0,
                                **({"structured": spec} if constrained else {"ignore_eos": True}))
        return step_times(engine, prompts, steps, params)[0] * 1e3

    ms = {"constrained": [], "free": []}
    with engine_cls(loaded, config) as engine:
        run(engine, True)  # warm-up: the grammar compiled, the tables built
        for _ in range(rounds):
            ms["constrained"].append(run(engine, True))
            ms["free"].append(run(engine, False))
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {"batch": batch, "ms_per_step": {k: round(v, 2) for k, v in med.items()},
            "overhead": round(med["constrained"] / med["free"] - 1, 4),
            "per_round": [round(c / f - 1, 4) for c, f in zip(ms["constrained"], ms["free"])]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the engine runs (float32 on the CPU, bfloat16 on CUDA)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tandem.engine.core.llm_engine import LLMEngine
    from tandem.engine.engine_config import EngineConfig

    loaded, dtype = embedded_on(args.device)
    outputs = reference_outputs(loaded, LLMEngine, EngineConfig(num_kv_blocks=2048, max_num_seqs=64, compile=False))
    result = {"bench": "structured_output", "machine": machine_line(), "cpu": cpu_report(), "threads": args.threads,
              "device": args.device, "dtype": dtype,
              **({"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else {}),
              "vocab": loaded.config.vocab_size, **compare_libraries(loaded, outputs), "engine": []}
    for batch in sorted({1, args.batch}):
        row = step_overhead(loaded, LLMEngine, EngineConfig, batch, args.steps, args.rounds)
        result["engine"].append(row)
        print(f"batch {batch}: constrained {row['ms_per_step']['constrained']} ms/step, free "
              f"{row['ms_per_step']['free']}: overhead {row['overhead']:.1%}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
