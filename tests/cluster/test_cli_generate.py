"""`tandem generate`: the --json contract later tooling relies on, streaming, sampling flags and bad flags."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tandem.cluster.cli import main
from tandem.engine.sampling_params import SamplingParams

CONTRACT_KEYS = {"text", "token_ids", "prompt_token_ids", "finish_reason", "timings"}


def _run_json(capsys, *args: str) -> dict:
    assert main(["generate", "--json", *args]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == 1, "--json must print exactly one line on stdout"
    return json.loads(lines[0])


def test_json_contract_matches_the_engine(capsys, embedded, embedded_generator):
    result = _run_json(capsys, "--chat", "Name three colors.", "--max-tokens", "12")
    assert set(result) == CONTRACT_KEYS
    assert set(result["timings"]) >= {"load_s", "ttft_s", "per_token_s"}
    assert result["timings"]["load_s"] > 0 and result["timings"]["ttft_s"] > 0
    ids = embedded.tokenizer.encode_chat([{"role": "user", "content": "Name three colors."}])
    assert result["prompt_token_ids"] == ids
    expected = embedded_generator.generate(ids, SamplingParams(max_tokens=12, temperature=0))
    assert result["token_ids"] == expected.token_ids
    assert result["text"] == expected.text == embedded.tokenizer.decode(expected.token_ids)
    assert result["finish_reason"] in ("stop", "length")
    if result["finish_reason"] == "length":
        assert len(result["token_ids"]) == 12


def test_stop_text_ends_the_output_before_it(capsys, embedded_generator, embedded):
    full = _run_json(capsys, "--prompt", "The capital of France is", "--max-tokens", "16", "--ignore-eos")
    stop = full["text"][6:10]
    cut = full["text"].index(stop)
    result = _run_json(capsys, "--prompt", "The capital of France is", "--max-tokens", "16", "--ignore-eos",
                       "--stop", stop)
    assert result["text"] == full["text"][:cut] and result["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(capsys):
    args = ("--prompt", "Once upon a time", "--max-tokens", "16", "--temperature", "1.2", "--top-p", "0.95",
            "--top-k", "50")
    a = _run_json(capsys, *args, "--seed", "7")
    b = _run_json(capsys, *args, "--seed", "7")
    c = _run_json(capsys, *args, "--seed", "8")
    greedy = _run_json(capsys, "--prompt", "Once upon a time", "--max-tokens", "16")
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"] or a["token_ids"] != greedy["token_ids"]


def test_streaming_prints_the_same_text(capsys, embedded, embedded_generator):
    assert main(["generate", "--prompt", "The capital of Italy is", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    ids = embedded.tokenizer.encode("The capital of Italy is")
    expected = embedded_generator.generate(ids, SamplingParams(max_tokens=8, temperature=0))
    assert out == expected.text + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "x", "--top-p", "0"], "top_p must be in"),
    (["--prompt", "x", "--max-tokens", "0"], "max_tokens must be at least 1"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt", "x", "--max-tokens", "9000"], "exceeds the maximum context length 8192"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "x", "--min-p", "2"], "min_p must be in"),
    (["--prompt", "x", "--stop", ""], "stop"),
    (["--prompt", "x", "--ep", "2"], "needs a mixture-of-experts model"),
    (["--prompt", "x", "--tp", "10"], "more than the model's 9 attention heads"),
    (["--prompt", "x", "--pp", "0"], "pp must be a positive integer"),
    (["--prompt", "x", "--tp", "2", "--weights", "packed"], "runs in one process"),
    (["--prompt", "x", "--device", "cuda", "--weights", "packed"], "runs on the CPU"),
])
def test_bad_flags_exit_2_with_a_message(capsys, flags, message):
    assert main(["generate", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda_says_what_to_install(capsys):
    import torch

    assert main(["generate", "--prompt", "x", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert f"device: cuda, but torch {torch.__version__} sees no CUDA device" in err
    assert "install a CUDA build of torch" in err and "Traceback" not in err


def test_split_replica_keeps_the_json_contract_and_the_tokens(capsys, embedded, embedded_generator):
    """--tp 2 --pp 2: four processes on this machine; same contract and the same greedy tokens as one."""
    args = ("--prompt", "The capital of France is", "--max-tokens", "10", "--ignore-eos")
    assert main(["generate", "--json", *args, "--tp", "2", "--pp", "2", "--verbose"]) == 0
    captured = capsys.readouterr()
    assert "rank 3: stage 1 layers 15-29, tp 1 KV heads 2-2" in captured.err
    split = json.loads(captured.out)
    assert set(split) == CONTRACT_KEYS
    ids = embedded.tokenizer.encode("The capital of France is")
    expected = embedded_generator.generate(ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert split["token_ids"] == expected.token_ids and split["text"] == expected.text


def test_console_script_streams(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "generate", "--chat", "Say hello.",
                           "--max-tokens", "6"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "TTFT" in proc.stderr


def test_verbose_names_the_probed_cpu_and_each_projections_kernel(capsys, monkeypatch):
    import torch

    from tandem.engine.hardware.cpu_features import cpu_features
    from tandem.engine.hardware.kernel_tuning import KernelTuner
    from tandem.engine.models.linear import tuned_plan

    monkeypatch.setenv("TANDEM_KERNEL_TUNING", "on")  # the measured plans (the suite runs the fixed ones)
    assert main(["generate", "--json", "--prompt", "Hi", "--max-tokens", "2", "--dtype", "bfloat16",
                 "--verbose", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "device: cpu bfloat16 (device: cpu)" in err
    assert cpu_features().describe() in err
    tuner = KernelTuner(cpu_features())
    assert f"kernels: measured on this CPU with {torch.get_num_threads()} thread(s)" in err
    # The measured plan of each shape (30 layers x 4 projections of 4 shapes, and the tied LM head).
    for shape, count in {(960, 576): 30, (576, 576): 30, (3072, 576): 30, (576, 1536): 30, (49152, 576): 1}.items():
        plan = tuned_plan(tuner, torch.bfloat16, *shape)
        assert f"  {shape[0]}x{shape[1]} ({count} x): {plan.describe()}" in err
    assert "decode attention: " in err


# What an AVX2-only CPU runs, reproduced on any x86-64 machine (on an AVX2 machine these change nothing).
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


# What an AVX2 CPU has of tandem's own kernels: their AVX2 path (the AVX-512 one is probed from the CPU's flags,
# which the variables above do not hide).
NO_AVX512_KERNELS = "cpu_kernels_avx512"


@pytest.mark.parametrize("flags, disable, packed_plan, packed_shapes", [
    (["--dtype", "bfloat16"], NO_AVX512_KERNELS, None, 0),
    # On tandem's kernels: QKV, O, gate/up and down packed, and the tied LM head read as the GGUF stores it
    # (Q8_0). On torch's int4 kernel without them: the four packed, the head dense. Without either: bfloat16.
    (["--weights", "packed"], NO_AVX512_KERNELS, "int_dot", 5),
    (["--weights", "packed"], f"{NO_AVX512_KERNELS},cpu_kernels", "int4", 4),
    (["--weights", "packed"], f"{NO_AVX512_KERNELS},cpu_kernels,int4", None, 0),
], ids=["bf16", "packed", "packed-int4", "packed-no-kernels"])
def test_bfloat16_modes_run_on_an_avx2_cpu(embedded, flags, disable, packed_plan, packed_shapes):
    """The modes that crashed on AVX2 CPUs (oneDNN has no bfloat16 inner product there) run, name the path
    they took, and give the same greedy tokens as the same path in this process."""
    import dataclasses
    import os

    import torch

    from tandem.engine.core.generator import Generator
    from tandem.engine.hardware.cpu_features import DISABLE_ENV, cpu_features
    from tandem.engine.loader import load_model

    prompt = "The capital of France is"
    proc = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "generate", "--json", "--verbose",
                           "--prompt", prompt, "--max-tokens", "6", "--ignore-eos", *flags],
                          capture_output=True, text=True, timeout=300,
                          env=os.environ | AVX2_ENV | {DISABLE_ENV: disable})
    assert proc.returncode == 0, proc.stderr
    assert "oneDNN bfloat16 inner product: no" in proc.stderr
    assert "bfloat16 projections on cpu: " in proc.stderr
    plans = [line.split("): ")[1] for line in proc.stderr.splitlines() if re.match(r"  \d+x\d+ \(\d+ x\): ", line)]
    assert len(plans) == 5 and plans.count(packed_plan) == packed_shapes, plans
    for plan in plans:  # what an AVX2 CPU runs: no oneDNN bfloat16
        assert plan == packed_plan or ("onednn" not in plan and ("linear" in plan or "widen" in plan)), plan
    features = dataclasses.replace(cpu_features(), onednn_bf16=False).without(disable.split(","), "as the subprocess")
    loaded = load_model(progress=False, dtype=torch.bfloat16, cpu=features,
                        weight_format="packed" if "packed" in flags else "dense")
    expected = Generator(loaded, max_model_len=64).generate(
        embedded.tokenizer.encode(prompt), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tokens = json.loads(proc.stdout)["token_ids"]
    assert len(tokens) == 6
    # On an AVX2 CPU the two runs are the same computation and agree on every token. On an AVX-512 one the
    # subprocess's elementwise ops dispatch to AVX2 code (other summation orders in bfloat16), so only the
    # confident start of the answer (" Paris." and what follows it) is compared there.
    same = 6 if cpu_features().capability == "AVX2" else 3
    assert tokens[:same] == expected.token_ids[:same]
