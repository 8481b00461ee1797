"""The `tandem` command line. Each subcommand parses its flags once, then calls into the layer that owns it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from tandem.engine.engine_config import KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZED_WEIGHTS, WEIGHT_FORMATS
from tandem.engine.errors import ReplicaFailedError, TandemError


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run the model on one prompt, in this process or across --tp/--pp/--ep",
                       description="Generate text with one replica: in this process, or split over tp x pp x ep "
                                   "processes on this machine. Streams text, or prints one JSON object (--json).")
    p.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--target", default=None, metavar="HOST:PORT",
                   help="send the request to a running cluster's gRPC endpoint instead of running the model here "
                        "(its API key, if it needs one, from the TANDEM_API_KEY environment variable)")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="with --target: connect over TLS, trusting this PEM CA (for a self-signed certificate, "
                        "the certificate itself)")
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="with --tls-ca: present this PEM client certificate (clusters with tls.client_ca_file)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the private key of --tls-cert")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="raw prompt text, tokenized as is")
    what.add_argument("--chat", help="a user message; the model's chat template is applied")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable); the stop text is not printed")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same output)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto (default): CUDA when this process sees a GPU, else the CPU; with --tp/--pp/--ep "
                        "rank r takes GPU r")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute precision (default: bfloat16 on CUDA, float32 on the CPU; bfloat16 with "
                        "quantized --weights)")
    p.add_argument("--weights", choices=list(WEIGHT_FORMATS), default="dense",
                   help="dense: expand every weight to --dtype; int8: per-output-channel int8 projections (any "
                        "checkpoint, CPU or CUDA); int4 / int4_g128: group-wise 4-bit projections, groups of 32 / "
                        "128 (CPU); packed: keep a GGUF file's Q4_0/Q4_1 weights "
                        "4-bit on the CPU (bfloat16 compute, ~4x less weight memory)")
    p.add_argument("--load-format", choices=list(LOAD_FORMATS), default="auto",
                   help="auto (default): read the model's weights; dummy: make random weights of the model's shapes "
                        "on the device (no weight file needed: `tandem make-model --like NAME`), to measure speed "
                        "and memory; the text is noise")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="what the KV cache stores (default auto: --dtype); int8 / fp8_e4m3 keep a scale per block "
                        "and head, about half bfloat16's bytes")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice; split "
                   "over the ranks when the replica spans processes)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (attention by KV heads, MLP by columns)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (layers split evenly)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models)")
    p.add_argument("--verbose", action="store_true", help="print the CPU's probed kernels, the kernel each projection "
                   "runs on and the replica layout (which rank holds what)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token_ids, prompt_token_ids, finish_reason, timings")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    if args.target is None and (args.tls_ca or args.tls_cert or args.tls_key):
        raise ValueError("--tls-ca, --tls-cert and --tls-key are for a cluster's endpoint: give --target too")
    if args.target is not None:
        from tandem.cluster.commands import generate_remote

        return generate_remote(args)
    import torch

    from tandem.engine.core.generator import Generator
    from tandem.engine.hardware.device import resolve_device
    from tandem.engine.loader import load_model
    from tandem.engine.parallel import ParallelConfig
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    quantized = args.weights in QUANTIZED_WEIGHTS
    cpu_only = args.weights in ("packed", "int4", "int4_g128")
    if cpu_only and args.device == "cuda":
        raise ValueError(f"--weights {args.weights} runs on the CPU (torch's int4 CPU kernel); use --weights int8 "
                         "on CUDA, or --device cpu")
    choice = resolve_device("cpu" if cpu_only else args.device, args.dtype or ("bfloat16" if quantized else None),
                            None, torch.cuda.device_count(), f"torch {torch.__version__}")
    dtype = choice.dtype
    if quantized and dtype != "bfloat16":
        raise ValueError(f"--weights {args.weights} computes in bfloat16; drop --dtype or pass --dtype bfloat16")
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep)
    if args.weights == "packed" and parallel.world_size > 1:
        raise ValueError("--weights packed runs in one process; drop it to split the model with --tp/--pp/--ep")
    # A replica over several processes: the ranks load their own shards, this process only the tokenizer.
    loaded = load_model(args.model, dtype=getattr(torch, dtype), device=choice.device, progress=sys.stderr.isatty(),
                        weight_format=args.weights, weights=parallel.world_size == 1, load_format=args.load_format)
    tokenizer = loaded.tokenizer
    if args.chat is not None:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.chat}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    # KV for this one request only (a 128k-context model would otherwise reserve its whole context). A request
    # longer than the model's context is still rejected by the generator with the model's limit in the message.
    needed = len(prompt_ids) + params.max_tokens
    context = loaded.config.max_position_embeddings
    with Generator(loaded, max_model_len=needed if needed <= context else context, parallel=parallel,
                   kv_cache_dtype=args.kv_cache_dtype) as generator:
        if args.verbose:
            print("\n".join([f"device: {choice.describe()}"] + loaded.describe_kernels()
                            + generator.engine.layout.describe()), file=sys.stderr)
        return _run(generator, prompt_ids, params, args.json)


def _run(generator, prompt_ids: list[int], params, as_json: bool) -> int:
    if as_json:
        result = generator.generate(prompt_ids, params)
        t = result.timings
        print(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "prompt_token_ids": result.prompt_token_ids,
            "finish_reason": result.finish_reason,
            "timings": {"load_s": t.load, "ttft_s": t.ttft, "per_token_s": t.per_token,
                        "decode_tokens_per_s": 1 / t.per_token if t.per_token else None},
        }, ensure_ascii=False))
        return 0
    for step in generator.stream(prompt_ids, params):
        sys.stdout.write(step.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    t = generator.last_timings
    rate = f"{1 / t.per_token:.1f} tok/s" if t.per_token else "n/a"
    print(f"[load {t.load:.2f}s, TTFT {t.ttft * 1000:.0f} ms, decode {rate}]", file=sys.stderr)
    return 0


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _add_cluster(sub: argparse._SubParsersAction) -> None:
    from tandem.cluster import commands

    p = sub.add_parser("validate", help="check a cluster manifest and report every error with its YAML path")
    p.add_argument("manifest")
    p.add_argument("--no-port-check", action="store_true", help="do not report listen ports already in use")
    p.set_defaults(func=commands.validate)

    p = sub.add_parser("up", help="start the cluster a manifest describes on Ray",
                       description="Connects to Ray (the manifest's ray.address; a local head is started when none "
                                   "runs, listening on the manifest's ray.host), places and starts every replica "
                                   "and the router, prints the endpoints and serves until `tandem down`, Ctrl-C, "
                                   "SIGTERM or SIGHUP (each stops the cluster and the Ray head it started; SIGTERM "
                                   "first drains the router: no new requests, the running ones finish within "
                                   "router.drain_timeout_s).")
    p.add_argument("manifest")
    p.add_argument("--address", default=None, help="Ray address (overrides the manifest's ray.address)")
    p.add_argument("--detach", action="store_true", help="return once the cluster serves and leave it running")
    p.add_argument("--ask", default=None, metavar="MESSAGE",
                   help="once ready, send this chat message through the gRPC client and print the streamed answer")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens for --ask (default 128)")
    p.add_argument("--placement-timeout", type=_positive_seconds, default=120.0, metavar="SECONDS",
                   help="how long each initial replica may wait for Ray to find room for it (default 120; on a "
                        "cloud cluster whose autoscaler must first add GPU nodes, e.g. 1800)")
    p.add_argument("--ready-timeout", type=_positive_seconds, default=600.0, metavar="SECONDS",
                   help="how long each initial replica may then take to load its model (default 600)")
    p.set_defaults(func=commands.up)

    for name, helptext in (("down", "stop a running cluster"),
                           ("status", "show pools (desired, pending, last scaling decision), replicas, queues, KV use"),
                           ("scale", "pin a pool at N replicas, or give it back to the autoscaler (auto)")):
        p = sub.add_parser(name, help=helptext)
        if name == "scale":
            p.add_argument("pool", choices=["prefill", "decode"])
            p.add_argument("count", help="a number of replicas, or auto")
        p.add_argument("--name", default="tandem", help="the manifest's name (default tandem)")
        p.add_argument("--namespace", default="tandem", help="the manifest's ray.namespace (default tandem)")
        p.add_argument("--address", default=None, help="Ray address (default: the local cluster)")
        if name == "down":
            p.add_argument("--drain", action="store_true",
                           help="drain the router first: /health turns not-ready, new requests get 503 / "
                                "UNAVAILABLE with Retry-After, running ones finish within router.drain_timeout_s")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print one JSON object")
            p.add_argument("--log", type=int, default=0, metavar="N",
                           help="also print the control plane's last N log lines (scaling decisions, failures)")
        p.set_defaults(func=getattr(commands, name))

    p = sub.add_parser("profile", help="measure what each pool of a manifest costs on this machine (prefill, decode "
                       "steps, KV bytes, KV transfer rate) and write it as a profile file",
                       description="Builds one replica of each pool in this process, as `tandem up` would (layout, "
                                   "dtype, threads, CPU pinning, token budget), times prefills by prompt length and "
                                   "count and decode steps by batch size and context, fits the step lines and writes "
                                   "them with the points as JSON (cluster/hardware_profile.py). For a disaggregated "
                                   "manifest it first measures the KV transfer rate between two processes on this "
                                   "host, with the manifest's transport settings. Takes one to a few minutes on the "
                                   "embedded model; progress goes to stderr.")
    p.add_argument("manifest")
    p.add_argument("--out", required=True, help="the profile file to write (JSON)")
    p.add_argument("--pools", type=_names, default=None, help="comma-separated pools to profile (default: all)")
    p.add_argument("--prompts", type=_counts, default=None, help="prompt lengths in tokens (default 128,512,1536)")
    p.add_argument("--prompt-counts", type=_counts, default=None,
                   help="prompts submitted together for each length (default 1,4)")
    p.add_argument("--batches", type=_counts, default=None, help="decode batch sizes (default 1,4,16,32)")
    p.add_argument("--contexts", type=_counts, default=None, help="decode contexts in tokens (default 64,1024)")
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps timed per point (default 5)")
    p.add_argument("--repeats", type=int, default=None, help="tries of each prefill point, the best kept (default 2)")
    p.add_argument("--transfer-bytes-per-s", type=float, default=None,
                   help="the KV transfer rate to record instead of measuring it (e.g. between two hosts); default: "
                        "measured on this host (a colocated manifest, which moves no KV, records DESIGN.md's "
                        "loopback UCX figure, marked as assumed)")
    p.set_defaults(func=commands.profile)

    p = sub.add_parser("make-model", help="write a small random model (tiny-moe, for deploy/manifests/local-moe.yaml), "
                       "or a published model's shape without weights (--like NAME, run with dummy weights)",
                       description="`tandem make-model tiny-moe OUT` writes a small Mixtral-layout model with random "
                                   "weights. `tandem make-model --like NAME OUT` writes the config.json of a "
                                   "published model (Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B, Qwen3-8B, "
                                   "Mixtral-8x7B, Mixtral-8x22B, Qwen3-30B-A3B) with the embedded tokenizer and no "
                                   "weights: serve or measure it with --load-format dummy / engine.load_format: dummy.")
    p.add_argument("kind", nargs="?", choices=["tiny-moe"], help="a small model with weights (omit with --like)")
    p.add_argument("out", help="folder to write")
    p.add_argument("--like", metavar="NAME", default=None,
                   help="a published model's name (e.g. Llama-3.1-8B; any unique start of one)")
    p.add_argument("--seed", type=int, default=0, help="tiny-moe's weights' seed")
    p.set_defaults(func=commands.make_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem: a disaggregated LLM serving cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_cluster(sub)
    from tandem.cluster.plan_command import add_parser as add_plan

    add_plan(sub)
    from tandem.bench.loadgen.command import add_parser as add_bench  # the load generator (a client of the API)

    add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ReplicaFailedError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 1
    except (TandemError, ValueError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a cluster that failed to start or cannot be found: the message says why
        print(f"tandem: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
