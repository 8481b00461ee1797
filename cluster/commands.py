"""The cluster subcommands of `tandem` (validate, up, down, status, profile, make-model, and generate --target); cli.py
parses the flags, these run them. Each returns the process exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _print_warnings(checked, source: str) -> None:
    for warning in checked.warnings:
        print(f"tandem: warning: {warning.format(source)}", file=sys.stderr)


def validate(args: argparse.Namespace) -> int:
    from tandem.cluster.manifest_checks import check_file, kv_conversion
    from tandem.cluster.manifest_yaml import ManifestInvalid

    try:
        checked = check_file(args.manifest, check_ports=not args.no_port_check)
    except ManifestInvalid as e:
        for error in e.errors:
            print(error.format(e.source), file=sys.stderr)
        print(f"tandem: {args.manifest}: {len(e.errors)} error(s)", file=sys.stderr)
        return 2
    _print_warnings(checked, args.manifest)
    manifest = checked.manifest
    pools = ", ".join(f"{name} {p.parallelism.tp}x{p.parallelism.pp}x{p.parallelism.ep} (tp x pp x ep) "
                      f"x {p.replicas.start} replica(s)" for name, p in manifest.pool_items())
    http = f", HTTP on {manifest.listen.http}" if manifest.listen.http else ""
    dummy = [name for name, p in manifest.pool_items() if p.engine.load_format == "dummy"]
    noise = f"; {' and '.join(dummy)} on dummy weights (load_format: dummy): answers are noise" if dummy else ""
    print(f"{args.manifest}: valid ({manifest.mode}; {pools}; gRPC on {manifest.listen.grpc}{http}; "
          f"routing {manifest.router.policy}{noise})")
    if (conversion := kv_conversion(manifest)) is not None:
        print(conversion)
    return 0


def up(args: argparse.Namespace) -> int:
    from tandem.cluster import launcher
    from tandem.cluster.manifest_checks import check_file
    from tandem.cluster.manifest_yaml import ManifestInvalid

    try:
        checked = check_file(args.manifest)
    except ManifestInvalid as e:
        for error in e.errors:
            print(error.format(e.source), file=sys.stderr)
        return 2
    _print_warnings(checked, args.manifest)
    manifest = checked.manifest
    launcher.stop_on_signals()
    cluster = launcher.up(manifest, address=args.address, detach=args.detach,
                           placement_timeout_s=args.placement_timeout, ready_timeout_s=args.ready_timeout)
    try:
        _serving(args, manifest, cluster)
    except BaseException:  # e.g. Ctrl-C during --ask: a foreground cluster goes down with this process
        if not args.detach:
            cluster.shutdown()
        raise
    if args.detach:
        return 0
    launcher.serve_until_stopped(cluster)
    return 0


def _serving(args: argparse.Namespace, manifest, cluster) -> None:
    """The endpoints of a cluster that serves, and the answer to --ask."""
    tls = manifest.tls
    tls_flag = "" if tls is None else f" --tls-ca {tls.client_ca}"
    print(f"tandem: cluster {manifest.name!r} is serving", file=sys.stderr)
    print(f"  gRPC      {cluster.endpoint}   (tandem generate --target {cluster.endpoint}{tls_flag} --chat \"Hi\")",
          file=sys.stderr)
    if cluster.http_endpoint:
        scheme = "http" if tls is None else "https"
        print(f"  HTTP      {scheme}://{cluster.http_endpoint}/v1   (OpenAI-compatible; /health, /metrics)",
              file=sys.stderr)
    print("  status    tandem status        stop: tandem down" + ("" if args.detach else " or Ctrl-C"),
          file=sys.stderr)
    if args.ask and tls is not None and tls.client_ca_file is not None:
        print("tandem: --ask skipped: the cluster requires client certificates (tls.client_ca_file); use tandem "
              "generate --target ... --tls-ca ... --tls-cert ... --tls-key ...", file=sys.stderr)
    elif args.ask:
        try:
            keys = manifest.auth.resolve()  # the sample request authenticates as the first tenant
            _ask(cluster.endpoint, args.ask, args.max_tokens, next(iter(keys), None),
                 None if tls is None else tls.client_ca)
        except Exception as e:
            print(f"tandem: the sample request failed: {e}", file=sys.stderr)


def _ask(target: str, message: str, max_tokens: int, api_key: str | None, tls_ca: str | None = None) -> None:
    """One chat request through the gRPC client, streamed to stdout, with TTFT and ITL. tls_ca: connect over
    TLS trusting this CA file (the certificate must name target's host)."""
    from tandem.router.client import TandemClient, TokenClock

    print(f"\n> {message}", flush=True)
    with TandemClient(target, api_key=api_key, tls_ca=tls_ca) as client:
        clock, usage, timings = TokenClock(), None, None
        for chunk in client.stream(chat=[{"role": "user", "content": message}], max_tokens=max_tokens,
                                   temperature=0.0):
            clock.tick(bool(chunk.token_ids))
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            if chunk.HasField("usage"):
                usage, timings = chunk.usage, chunk.timings
    print()
    print(f"[TTFT {1000 * (clock.ttft_s or 0):.0f} ms, ITL {1000 * clock.mean_itl_s:.1f} ms/token (client); "
          f"{usage.completion_tokens} tokens, prompt {usage.prompt_tokens} ({usage.cached_tokens} cached); "
          f"server TTFT {1000 * timings.ttft_s:.0f} ms]\n", file=sys.stderr, flush=True)


def down(args: argparse.Namespace) -> int:
    from tandem.cluster import launcher

    launcher.down(args.name, address=args.address, namespace=args.namespace, drain=args.drain)
    return 0


def status(args: argparse.Namespace) -> int:
    from tandem.cluster import launcher

    report = launcher.find(args.name, address=args.address, namespace=args.namespace).status()
    if args.json:
        print(json.dumps(report))
        return 0
    http = f", HTTP {report['endpoints']['http']}" if report["endpoints"].get("http") else ""
    print(f"cluster {report['name']}: {report['state']} ({report['mode']}, model {report['model']}), "
          f"gRPC {report['endpoints']['grpc']}{http}")
    for name, pool in report["pools"].items():
        p = pool["parallelism"]
        scaling = ("pinned at " + str(pool["pinned"]) if pool.get("pinned") is not None
                   else "autoscaled" if pool.get("autoscaling") else "fixed")
        print(f"  pool {name}: {pool['ready']} ready, {pool.get('pending', 0)} pending, {pool.get('draining', 0)} "
              f"draining, desired {pool.get('desired', pool['count'])} ({scaling}, min {pool['replicas']['min']} "
              f"max {pool['replicas']['max']}); tp={p['tp']} pp={p['pp']} ep={p['ep']}")
        last = pool.get("last_decision")
        if last:
            print(f"    last decision {last['age_s']:g} s ago: {last['action']} {last['from']} -> {last['to']}: "
                  f"{last['reason']}")
        if pool.get("shortfall"):
            short = pool["shortfall"]
            print(f"    shortfall: {short['replicas']} replica(s) of {short['bundle']} could not be placed")
    for r in report["replicas"]:
        kv = (f"KV {r['kv_blocks_in_use']}/{r['kv_blocks_total']} blocks ({100 * r['kv_usage']:.0f}%"
              f"{', ' + r['kv_dtype'] if r.get('kv_dtype') else ''})" if "kv_blocks_total" in r else "")
        weights = f", {r['weights']} weights" if r.get("weights") not in (None, "dense") else ""
        queues = (f"running {r['running']}, waiting {r['waiting']}, waiting for KV {r['waiting_for_kv']}, "
                  f"in flight {r.get('in_flight', 0)}" if "running" in r else r.get("error", ""))
        print(f"    {r['name']:<12} {r['state']:<12} node {r.get('node')} pid {r.get('pid')} "
              f"({r.get('device')}{weights})  "
              f"{queues}  {kv}")
        if r.get("speculation"):
            s = r["speculation"]
            rate = f"{100 * s['accepted'] / s['proposed']:.0f}%" if s["proposed"] else "-"
            print(f"      speculative decoding ({s['proposer']}): {s['accepted']} of {s['proposed']} proposed tokens "
                  f"accepted ({rate}), {s['declined_steps']} steps without proposals worth verifying")
        if r.get("kv_tiers"):
            print(f"      {kv_tiers_line(r['kv_tiers'], r.get('kv_tier_hit_costs'))}")
        placements = {p["rank"]: p for p in r.get("rank_placements", [])}
        for i, rank in enumerate(r.get("ranks", [])):
            print(f"      {rank}{_rank_place(placements.get(i, {}))}")
    router = report["router"]
    print(f"  router: {router.get('state')}, active {router.get('active_requests', 0)}, queued "
          f"{router.get('queued_requests', 0)}, finished {router.get('finished_requests', 0)}, failed "
          f"{router.get('failed_requests', 0)}, policy {router.get('policy', '-')}, standby "
          f"{router.get('standby', 'absent')}")
    if router.get("prefill_decisions"):
        print("  prefilled: " + ", ".join(f"{k} {v}" for k, v in sorted(router["prefill_decisions"].items())))
    if args.log:
        cluster_log = launcher.find(args.name, address=args.address, namespace=args.namespace).log()
        print("\n".join(cluster_log[-args.log:]))
    return 0


def scale(args: argparse.Namespace) -> int:
    from tandem.cluster import launcher

    count = None if args.count == "auto" else _count(args.count)
    if count is False:
        print(f"tandem: error: scale takes a number of replicas (0 or more) or auto, got {args.count!r}",
              file=sys.stderr)
        return 2
    print(launcher.find(args.name, address=args.address, namespace=args.namespace).scale(args.pool, count))
    return 0


def _count(text: str) -> int | bool:
    return int(text) if text.isdigit() else False


def kv_tiers_line(t: dict, costs: dict | None = None) -> str:
    """A replica's KV tiers in one line of `tandem status` (a TierStats as a dict; costs: its TierHitCosts as a
    dict, what a hit on each tier costs against recomputing the block, as the router weighs them)."""
    line = f"KV tiers: host {t['host_blocks']}/{t['host_capacity']} blocks, {t['host_hits']} hits"
    if t["disk_capacity"]:
        line += f"; disk {t['disk_blocks']}/{t['disk_capacity']} blocks, {t['disk_hits']} hits"
    line += f"; {t['saved']} saved, {t['spilled']} spilled"
    if costs:
        line += f"; a hit costs {100 * costs['host']:.0f}%"
        if t["disk_capacity"]:
            line += f" (host), {100 * costs['disk']:.0f}% (disk)"
        line += " of recomputing" + ("" if costs["measured"] else " (not measured yet)")
    if t["failures"]:
        line += "; failed: " + ", ".join(f"{reason} {n}" for reason, n in sorted(t["failures"].items()))
    return line


def _rank_place(placement: dict) -> str:
    """Where a rank runs, as `tandem status` prints it after the rank's layout line: its GPUs and the host CPUs
    it may run on (all of the host's unless the pool sets cpu_affinity)."""
    from tandem.engine.hardware.cpu_affinity import format_cpus

    gpus, cpus = placement.get("visible_gpus"), placement.get("cpus")
    return (f", GPU {gpus}" if gpus else "") + (f", CPUs {format_cpus(cpus)}" if cpus else "")


def profile(args: argparse.Namespace) -> int:
    import dataclasses

    from tandem.cluster.hardware_profile import write_profile
    from tandem.cluster.manifest_checks import check_file
    from tandem.cluster.manifest_yaml import ManifestInvalid
    from tandem.cluster.profiler import Grid, profile_manifest

    try:
        checked = check_file(args.manifest, check_ports=False)
    except ManifestInvalid as e:
        for error in e.errors:
            print(error.format(e.source), file=sys.stderr)
        return 2
    _print_warnings(checked, args.manifest)
    given = {name: getattr(args, name) for name in ("prompts", "prompt_counts", "batches", "contexts", "decode_steps",
                                                    "repeats") if getattr(args, name) is not None}
    grid = dataclasses.replace(Grid(), **given)
    found = profile_manifest(checked.manifest, args.manifest, grid, pools=args.pools,
                             transfer_bytes_per_s=args.transfer_bytes_per_s,
                             say=lambda line: print(line, file=sys.stderr, flush=True))
    write_profile(found, args.out)
    print(f"tandem: wrote the profile of {', '.join(found.pools)} on {found.machine} to {args.out}")
    return 0


def make_model(args: argparse.Namespace) -> int:
    """tandem make-model: tiny-moe (weights written), or --like NAME (a published shape, no weights)."""
    if (args.kind is None) == (args.like is None):
        raise ValueError("make-model takes a kind (tiny-moe) or --like NAME, one of the two")
    if args.like is not None:
        from tandem.engine.loader.model_info import load_model_info
        from tandem.engine.loader.published_models import find_published, write_published_shape

        hub = find_published(args.like)
        folder = write_published_shape(hub, args.out, load_model_info(None).tokenizer)
        info = load_model_info(folder)  # reads back what was written: the shape tandem will run
        c = info.config
        print(f"tandem: wrote the shape of {hub} to {folder} ({c.num_layers} layers, hidden {c.hidden_size}, "
              f"{c.num_heads}/{c.num_kv_heads} heads{f', {c.moe.num_experts} experts' if c.moe else ''}); no "
              f"weights: run it with --load-format dummy (engine.load_format: dummy in a manifest)", file=sys.stderr)
        return 0
    from tandem.engine.loader.synthetic import write_synthetic_model

    folder = write_synthetic_model(args.kind, args.out, seed=args.seed)
    print(f"tandem: wrote {args.kind} (seed {args.seed}) to {folder}", file=sys.stderr)
    return 0


def generate_remote(args: argparse.Namespace) -> int:
    """tandem generate --target HOST:PORT: the same flags, through the gRPC API."""
    import grpc

    from tandem.router.client import TandemClient

    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                    presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                    stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)
    prompt = {"chat": [{"role": "user", "content": args.chat}]} if args.chat is not None else {"prompt": args.prompt}
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    tls_cert = None if args.tls_cert is None else (args.tls_cert, args.tls_key)
    try:
        client = TandemClient(args.target, api_key=os.environ.get("TANDEM_API_KEY") or None, tls_ca=args.tls_ca,
                              tls_cert=tls_cert)
    except OSError as e:
        print(f"tandem: error: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    try:
        with client:
            if args.json:
                r = client.generate(**prompt, **sampling)
                print(json.dumps({"text": r.text, "token_ids": r.token_ids.get(0, []),
                                  "finish_reason": r.finish_reason, "request_id": r.request_id,
                                  "prefill_replica": r.prefill_replica, "decode_replica": r.decode_replica,
                                  "usage": {"prompt_tokens": r.usage.prompt_tokens,
                                            "cached_tokens": r.usage.cached_tokens,
                                            "completion_tokens": r.usage.completion_tokens},
                                  "timings": {"ttft_s": r.timings.ttft_s, "mean_itl_s": r.timings.mean_itl_s,
                                              "e2e_s": r.timings.e2e_s}}, ensure_ascii=False))
                return 0
            for chunk in client.stream(**prompt, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.HasField("timings"):
                    t = chunk.timings
                    print(f"\n[TTFT {1000 * t.ttft_s:.0f} ms, ITL {1000 * t.mean_itl_s:.1f} ms/token, "
                          f"{chunk.usage.completion_tokens} tokens]", file=sys.stderr)
    except grpc.RpcError as e:
        hint = ("\n  (if the cluster serves TLS, give --tls-ca)" if e.code() == grpc.StatusCode.UNAVAILABLE
                and args.tls_ca is None else "")
        print(f"tandem: error: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
        return 1
    return 0
