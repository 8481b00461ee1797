"""Settings of one engine replica, parsed once where it is built. Sizes: tokens for lengths, bytes for memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, get_args

from annotated_types import Ge, Gt, Interval, Le

from tandem.engine.sampling_params import MAX_SPECULATIVE_TOKENS

DEFAULT_CPU_KV_FRACTION = 0.25  # of available RAM: the CPU is shared with the tokenizer, the OS and peers
DEFAULT_GPU_KV_FRACTION = 0.90  # of free device memory after the weights are loaded
AttentionBackend = Literal["auto", "torch", "triton"]  # auto: Triton on CUDA, the torch reference elsewhere
ATTENTION_BACKENDS = get_args(AttentionBackend)
# How projection weights are held (engine/models/llama.py): dense in the compute dtype; packed: a GGUF file's
# Q4_0/Q4_1 layers kept 4-bit; int8: every projection per-output-channel int8 (engine/models/int8.py); int4 /
# int4_g128: every projection group-wise 4-bit, groups of 32 / 128 (engine/models/int4.py), the LM head int8.
WEIGHT_FORMATS = ("dense", "packed", "int8", "int4", "int4_g128")
QUANTIZED_WEIGHTS = ("packed", "int8", "int4", "int4_g128")  # these compute in bfloat16
QUANTIZED_ON_LOAD = ("int8", "int4", "int4_g128")  # quantized from the checkpoint's floats as they are read
# Where the weights come from (engine/loader/): auto reads the model's files; dummy makes random weights of the
# config's shapes on each rank's device (engine/loader/dummy_weights.py), for measuring models not on this machine.
LoadFormat = Literal["auto", "dummy"]
LOAD_FORMATS = get_args(LoadFormat)
# What the KV cache stores (engine/kv/kv_cache.py): auto is the compute dtype; int8 and fp8_e4m3 hold codes with a
# float32 scale per block, layer, K/V and KV head, computed from the data as tokens are written.
KVCacheDtype = Literal["auto", "bfloat16", "float16", "int8", "fp8_e4m3"]
KV_CACHE_DTYPES = get_args(KVCacheDtype)

ProposerName = Literal["ngram", "suffix", "draft"]  # speculative decoding's proposers (engine/decoding/speculation.py)
PROPOSERS = get_args(ProposerName)
SELF_DRAFT = "self"  # the draft setting for the target's own GGUF weights run packed 4-bit (the CPU only)


@dataclass(frozen=True)
class SpeculativeConfig:
    """proposer: "ngram", "suffix" or "draft". max_tokens: proposals per sequence and step at most (the cost model
    picks 0..max_tokens). ngram_min/ngram_max: the n-gram proposer's match lengths. suffix_cached_requests: finished
    requests whose outputs the suffix proposer keeps per tenant. draft: the draft model, "self" (the target's GGUF
    weights run packed 4-bit: engine/decoding/draft_proposer.py) or a model path. adaptive: False proposes max_tokens
    whenever the proposer has them (benchmarks and tests of verification; production keeps True). Raises
    ValueError for values out of range."""

    proposer: ProposerName = "suffix"
    max_tokens: Annotated[int, Interval(ge=1, le=MAX_SPECULATIVE_TOKENS)] = 4
    ngram_min: Annotated[int, Ge(1)] = 2
    ngram_max: Annotated[int, Ge(1)] = 4
    suffix_cached_requests: Annotated[int, Ge(0)] = 256
    adaptive: bool = True
    draft: str = SELF_DRAFT

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise ValueError(f"speculative proposer must be one of {', '.join(PROPOSERS)}, got {self.proposer!r}")
        if not 1 <= self.max_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative max_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {self.max_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.suffix_cached_requests < 0:
            raise ValueError(f"suffix_cached_requests must be >= 0, got {self.suffix_cached_requests}")


MAX_LORA_RANK = 256


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (engine/models/lora.py): max_loaded adapters at once per replica
    in a preallocated pool (others wait, least recently used leaves first), each of rank up to max_rank. Raises
    ValueError for values out of range."""

    max_rank: Annotated[int, Interval(ge=1, le=MAX_LORA_RANK)] = 64
    max_loaded: Annotated[int, Ge(1)] = 4

    def __post_init__(self) -> None:
        if not 1 <= self.max_rank <= MAX_LORA_RANK:
            raise ValueError(f"lora max_rank must be in 1..{MAX_LORA_RANK}, got {self.max_rank}")
        if self.max_loaded < 1:
            raise ValueError(f"lora max_loaded must be at least 1, got {self.max_loaded}")


@dataclass(frozen=True)
class KVTiersConfig:
    """KV cache tiers below the device's pool (engine/core/kv_tiers.py): prefix blocks the pool evicts are kept in
    host memory (host_bytes for the whole replica; page-locked on a GPU) and, with disk_path, in files there
    (disk_bytes at most; a folder per replica and rank, removed when the replica stops). Each tier is LRU; the
    host tier spills to the disk tier. Raises ValueError for sizes out of range or a disk budget without a path
    (or the reverse)."""

    host_bytes: Annotated[int, Ge(1)]
    disk_path: str | None = None
    disk_bytes: Annotated[int, Ge(1)] | None = None

    def __post_init__(self) -> None:
        if self.host_bytes < 1:
            raise ValueError(f"kv_tiers host_bytes must be positive, got {self.host_bytes}")
        if (self.disk_path is None) != (self.disk_bytes is None):
            raise ValueError("kv_tiers: give disk_path and disk_bytes together (a folder and its byte budget)")
        if self.disk_bytes is not None and self.disk_bytes < 1:
            raise ValueError(f"kv_tiers disk_bytes must be positive, got {self.disk_bytes}")


SchedulingPolicy = Literal["fcfs", "priority", "sjf", "fair"]  # engine/core/scheduling_policy.py
SCHEDULING_POLICIES = get_args(SchedulingPolicy)


@dataclass(frozen=True)
class SchedulingConfig:
    """The order in which a replica's scheduler serves its sequences (engine/core/scheduling_policy.py). policy:
    fcfs (arrival), priority (priority, then arrival), sjf (shortest prompt first; one that waited sjf_aging_s
    goes before every one that has not), fair (the step's tokens shared between tenants by weight: start-time fair
    queueing over tokens). preempt_after_s: a waiting sequence of higher priority that could not start for this
    long preempts running ones of lower priority (None: never; preemption then only makes room for running ones).
    fair_reserve_s: under fair, a tenant keeps its share of each step's prompt tokens this long after it last had
    a sequence here (running or waiting), though it has no prompt to compute, so that its next request does not
    wait behind a step another tenant's prompts filled (0: a step's prompt tokens go to the tenants with prompts
    to compute). tenant_weights: (tenant, weight) pairs for fair; others weigh default_weight. Raises ValueError
    for values out of range."""

    policy: SchedulingPolicy = "priority"
    preempt_after_s: Annotated[float, Ge(0)] | None = None
    sjf_aging_s: Annotated[float, Gt(0)] = 30.0
    fair_reserve_s: Annotated[float, Ge(0)] = 0.0
    tenant_weights: tuple[tuple[str, float], ...] = ()
    default_weight: Annotated[float, Gt(0)] = 1.0

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduler policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        if self.preempt_after_s is not None and self.preempt_after_s < 0:
            raise ValueError(f"preempt_after_s must be >= 0, got {self.preempt_after_s}")
        if self.policy == "fcfs" and self.preempt_after_s is not None:
            raise ValueError("preempt_after_s preempts by priority, which policy fcfs ignores: use priority, sjf or "
                             "fair, or drop preempt_after_s")
        if not self.sjf_aging_s > 0:
            raise ValueError(f"sjf_aging_s must be positive, got {self.sjf_aging_s}")
        if not self.fair_reserve_s >= 0:
            raise ValueError(f"fair_reserve_s must be >= 0, got {self.fair_reserve_s}")
        if self.fair_reserve_s and self.policy != "fair":
            raise ValueError(f"fair_reserve_s keeps tenants' shares of the step under policy fair, not "
                             f"{self.policy}: use policy fair, or drop fair_reserve_s")
        if not self.default_weight > 0 or any(not w > 0 for _, w in self.tenant_weights):
            raise ValueError("tenant weights must be positive")

    def weight(self, tenant: str | None) -> float:
        return dict(self.tenant_weights).get(tenant, self.default_weight) if tenant is not None else \
            self.default_weight


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step. Tokens are counted over the whole batch (prefill chunks + decodes)."""

    max_model_len: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    max_loras: int = 0  # LoRA adapters that may run at once (the runner's pool: engine/models/lora.py)
    scheduling: SchedulingConfig = SchedulingConfig()  # the order, and priority preemption

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be at least max_model_len ({self.max_model_len}) to fit a whole prompt")


@dataclass(frozen=True)
class EngineConfig:
    """KV budget: exactly one of num_kv_blocks, kv_cache_bytes, kv_cache_fraction may be set; with none, the
    default fraction of the device's free memory applies. max_model_len None: the model's own context.

    The one definition of each engine setting: a manifest's `engine:` section takes these fields, types and
    defaults as they are (cluster/engine_settings.py). The ranges in the annotations (annotated_types) are what
    the manifest checks per key; __post_init__ checks them here too, and what no annotation says."""

    block_size: Annotated[int, Ge(1)] = 16
    num_kv_blocks: Annotated[int, Ge(1)] | None = None
    kv_cache_bytes: Annotated[int, Ge(1)] | None = None
    kv_cache_fraction: Annotated[float, Gt(0), Le(1)] | None = None
    max_model_len: Annotated[int, Ge(1)] | None = None
    max_num_batched_tokens: Annotated[int, Ge(1)] = 2048
    max_num_seqs: Annotated[int, Ge(1)] = 128
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    check_integrity: bool = False  # verify KV ownership after every step (debug; costs O(blocks) per step)
    attention_backend: AttentionBackend = "auto"
    # Compile the decode step (engine/models/compiled.py) at start-up; "background": on the CPU, serve eager at once
    # while it compiles in a thread, then compiled; None: as TANDEM_COMPILE says (default on).
    compile: bool | Literal["background"] | None = None
    # Speculative decoding (engine/decoding/speculation.py): None decodes one token per step.
    speculative: SpeculativeConfig | None = None
    kv_cache_dtype: KVCacheDtype = "auto"
    # KV tiers below the device pool (host memory, local disk) for evicted prefix blocks; None: the pool only.
    kv_tiers: KVTiersConfig | None = None
    # LoRA adapters (engine/models/lora.py): None serves the base model only.
    lora: LoRAConfig | None = None
    # The order the scheduler serves sequences in, and when a higher priority preempts (a pool's `scheduler:`).
    scheduling: SchedulingConfig = SchedulingConfig()

    def __post_init__(self) -> None:
        if self.kv_tiers is not None and not self.enable_prefix_caching:
            raise ValueError("kv_tiers keep evicted prefix blocks: they need enable_prefix_caching")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        budgets = [n for n in ("num_kv_blocks", "kv_cache_bytes", "kv_cache_fraction") if getattr(self, n) is not None]
        if len(budgets) > 1:
            raise ValueError(f"give one KV budget, not {' and '.join(budgets)}")
        for name in ("num_kv_blocks", "max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")

    def num_blocks(self, bytes_per_block: int, free_bytes: int, on_gpu: bool) -> int:
        """Blocks the budget buys, given one block's bytes (all layers, K and V) and the free memory.
        Raises ValueError if the budget does not buy a single block."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if self.kv_cache_bytes is not None:
            budget = self.kv_cache_bytes
        else:
            fraction = self.kv_cache_fraction or (DEFAULT_GPU_KV_FRACTION if on_gpu else DEFAULT_CPU_KV_FRACTION)
            budget = int(free_bytes * fraction)
        blocks = budget // bytes_per_block
        if blocks < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {bytes_per_block} bytes; raise it")
        return blocks


def available_memory_bytes(device) -> int:
    """Free memory the KV cache may take: free device memory on CUDA, MemAvailable of the host otherwise."""
    import torch  # here, not at the top: the rest of this module is policy and stays torch-free

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
