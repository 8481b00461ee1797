"""From a path to a runnable model: read the checkpoint (the loader its format needs), then repack it for the
device."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.engine_config import LOAD_FORMATS
from tandem.engine.errors import ModelLoadError
from tandem.engine.hardware.cpu_features import CpuFeatures, cpu_features
from tandem.engine.hardware.kernel_tuning import KernelTuner
from tandem.engine.loader.checkpoint import Checkpoint
from tandem.engine.loader.dummy_weights import dummy_checkpoint
from tandem.engine.loader.gguf_file import load_gguf
from tandem.engine.loader.hf_folder import load_hf_folder, shard_files
from tandem.engine.loader.model_info import load_model_info, resolve_model_path
from tandem.engine.model_config import ModelConfig
from tandem.engine.models import LlamaModel, build_model
from tandem.engine.models.linear import fixed_plan
from tandem.engine.tokenizer import Tokenizer


def load_checkpoint(path: str | Path | None = None, *, progress: bool = True, packed: bool = False,
                    weights: bool = True, load_format: str = "auto", seed: int = 0) -> Checkpoint:
    """Reads config and tokenizer from `path` (a HF folder or a .gguf file; None: the embedded model), and
    indexes its weights: LazyTensor values that build_model reads, each rank only its own shard's slices.

    packed: keep a GGUF file's Q4_0/Q4_1 projection weights as 4-bit Int4Weight values.
    weights: False reads only the config and tokenizer (load_model_info; weights is {}), for a driver whose
    ranks load their own shards; a folder's safetensors files must still all be there (auto).
    load_format: engine_config.LOAD_FORMATS; dummy reads no weight file (a folder needs only config.json and the
    tokenizer: `tandem make-model --like NAME`) and gives DummyTensor values made on the device they are read to,
    deterministic for `seed` (engine/loader/dummy_weights.py).
    Raises ModelLoadError with a message naming the path and the problem (for a tensor whose data cannot be
    read: when it is read), ValueError for an unknown load format or packed with dummy.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    source = resolve_model_path(path)
    if load_format == "dummy":
        if packed:
            raise ValueError("packed 4-bit weights are a GGUF file's own blocks; load_format dummy has none "
                             "(use weights dense, int8 or int4)")
        info = load_model_info(source)
        return dummy_checkpoint(info, seed=seed) if weights else Checkpoint(
            config=info.config, weights={}, tokenizer=info.tokenizer, source=info.source)
    if source.is_dir() and packed:
        raise ModelLoadError(f"{source}: packed 4-bit weights come from GGUF Q4_0/Q4_1 files; "
                             "a Hugging Face folder has none (drop --weights packed)")
    if not weights:
        info = load_model_info(source)
        if source.is_dir():
            shard_files(source)  # the ranks will read them: a missing shard is reported here, not by a rank
        return Checkpoint(config=info.config, weights={}, tokenizer=info.tokenizer, source=info.source)
    if source.is_dir():
        return load_hf_folder(source, progress=progress)
    return load_gguf(source, progress=progress, packed=packed)


@dataclass
class LoadedModel:
    """model is None when only the config and tokenizer were read (weights=False): the ranks of a replica that
    spans processes load their own shards from `source`."""

    model: LlamaModel | None
    tokenizer: Tokenizer
    config: ModelConfig
    source: Path
    load_seconds: float
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    weight_format: str = "dense"  # engine_config.WEIGHT_FORMATS: how the projections are held (ranks too)
    load_format: str = "auto"  # engine_config.LOAD_FORMATS: where the weights came from (ranks load the same way)

    def describe_kernels(self) -> list[str]:
        """What runs the weight products, for `tandem generate --verbose`: the CPU's probe and how kernels were
        chosen (on the CPU), how many projections run on each plan, each weight shape's plan and the decode
        attention plan (without weights: each rank chooses its own, as its probe and tuner say)."""
        on_cpu = self.device.type == "cpu"
        cpu = (self.model.cpu if self.model is not None else None) or (cpu_features() if on_cpu else None)
        dtype = str(self.dtype).removeprefix("torch.")
        lines = [cpu.describe()] if cpu else []
        if self.model is None:
            how = "as each rank's probe and tuner choose" if on_cpu else fixed_plan(self.dtype, self.device).describe()
            return lines + [f"{dtype} projections on {self.device}: {how}"]
        if on_cpu:
            tuner = self.model.tuner
            lines.append(tuner.describe() if tuner else KernelTuner(cpu, enabled=False).describe())
        kernels = "; ".join(f"{n} x {k}" for k, n in self.model.kernel_counts().items())
        lines.append(f"{dtype} projections on {self.device}: {kernels}")
        lines += [f"  {shape} ({n} x): {plan}" for shape, (n, plan) in self.model.kernel_plans().items()]
        lines.append(f"decode attention: {self.model.decode_plan.describe('sequence')}")
        return lines


def load_model(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", progress: bool = True, weights: bool = True,
               cpu: CpuFeatures | None = None, tuner: KernelTuner | None = None,
               weight_format: str = "dense", load_format: str = "auto", seed: int = 0) -> LoadedModel:
    """Loads weights and tokenizer from `path` (None: the embedded model). Raises ModelLoadError on bad input.

    weight_format: engine_config.WEIGHT_FORMATS: packed runs a GGUF file's Q4_0/Q4_1 projections on the packed
    4-bit kernel; int8 and int4 quantize every projection of any checkpoint (int4 keeps a GGUF file's Q4_0/Q4_1
    blocks as they are); all but dense need dtype=torch.bfloat16.
    weights: False reads only the config and tokenizer (model is None).
    load_format: engine_config.LOAD_FORMATS (load_checkpoint): dummy makes weights of the config's shapes on
    `device` instead of reading them, deterministic for `seed`.
    cpu: what the CPU runs, for the kernel choice (default: this process's probe, engine/hardware/cpu_features.py).
    tuner: measures the kernel choice on this CPU (default: as the environment says, engine/hardware/kernel_tuning.py).
    """
    start = time.perf_counter()
    checkpoint = load_checkpoint(path, progress=progress, packed=keeps_q4_blocks(path, weight_format, load_format),
                                 weights=weights, load_format=load_format, seed=seed)
    model = None
    if weights:
        model = build_model(checkpoint.config, checkpoint.weights, dtype=dtype, device=device,
                            source=str(checkpoint.source), cpu=cpu, tuner=tuner, weight_format=weight_format)
    return LoadedModel(model=model, tokenizer=checkpoint.tokenizer, config=checkpoint.config,
                       source=checkpoint.source, load_seconds=time.perf_counter() - start, dtype=dtype,
                       device=torch.device(device), weight_format=weight_format, load_format=load_format)


def keeps_q4_blocks(path: str | Path | None, weight_format: str, load_format: str = "auto") -> bool:
    """Whether the loader keeps a GGUF file's Q4_0/Q4_1 blocks 4-bit for this weight format: packed always
    (a folder, or dummy weights, then fail with the reason), int4 for a GGUF file read as it is (its blocks are
    already what int4 makes; dummy weights are floats that int4 quantizes as they are read)."""
    if weight_format == "packed":
        return True
    return (load_format == "auto" and weight_format in ("int4", "int4_g128")
            and not resolve_model_path(path).is_dir())
