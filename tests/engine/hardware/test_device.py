"""Device and dtype selection (engine/hardware/device.py): what the manifest asks, what Ray gave the rank, what torch
sees."""

from __future__ import annotations

import pytest

from tandem.engine.hardware.device import default_dtype, planned_device, resolve_device, split_gpu_ids


def test_auto_takes_cuda_only_when_the_rank_was_given_a_gpu():
    assert resolve_device("auto", None, ["3"], cuda_devices=1).device == "cuda"
    assert resolve_device("auto", None, [], cuda_devices=8).device == "cpu"  # Ray gave it none: all are others'
    assert resolve_device("auto", None, None, cuda_devices=2).device == "cuda"  # outside Ray: what it sees
    assert resolve_device("auto", None, None, cuda_devices=0).device == "cpu"


def test_dtype_defaults_by_device_and_an_explicit_one_wins():
    assert resolve_device("cuda", None, ["0"], 1).dtype == "bfloat16"
    assert resolve_device("cpu", None, ["0"], 1).dtype == "float32"
    assert resolve_device("cuda", "float32", ["0"], 1).dtype == "float32"
    assert (default_dtype("cuda"), default_dtype("cpu")) == ("bfloat16", "float32")


def test_cpu_forced_ignores_the_gpus_it_was_given():
    choice = resolve_device("cpu", None, ["0", "1"], cuda_devices=0)
    assert (choice.device, choice.reason) == ("cpu", "device: cpu")


def test_cuda_without_a_gpu_from_ray_or_from_torch_is_an_error_that_says_what_to_do():
    with pytest.raises(ValueError, match=r"gave this replica no GPU.*resources: \{gpus: 1\}"):
        resolve_device("cuda", None, [], cuda_devices=8)
    with pytest.raises(ValueError, match=r"torch 2.13.0\+cpu sees no CUDA device.*CUDA build of torch"):
        resolve_device("cuda", None, None, cuda_devices=0, torch_version="torch 2.13.0+cpu")
    # auto on a rank Ray gave a GPU, but this torch cannot use it: say so instead of running on the CPU
    with pytest.raises(ValueError, match=r"Ray gave it GPU 2, but torch sees no CUDA device.*device: cpu"):
        resolve_device("auto", None, ["2"], cuda_devices=0)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        resolve_device("tpu", None, None, 0)
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        resolve_device("cpu", "float8", None, 0)


def test_the_replicas_gpus_split_evenly_over_its_ranks_in_rank_order():
    assert split_gpu_ids(["4", "5", "6", "7"], 4) == ("4", "5", "6", "7")
    assert split_gpu_ids([0, 1, 2, 3], 2) == ("0,1", "2,3")  # two GPUs per rank
    assert split_gpu_ids(["1"], 1) == ("1",)
    assert split_gpu_ids([], 2) == ("", "")  # a CPU pool: no GPU for anyone
    with pytest.raises(ValueError, match="do not split evenly over 2 ranks"):
        split_gpu_ids(["0"], 2)  # a fraction of one GPU for two ranks


def test_planned_device_follows_the_pools_gpu_request():
    assert planned_device("auto", 1) == planned_device("auto", 0.5) == planned_device("cuda", 0) == "cuda"
    assert planned_device("auto", 0) == planned_device("cpu", 1) == "cpu"
