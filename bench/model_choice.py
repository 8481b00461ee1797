"""Which model a benchmark measures, and its transformers peer, from the command line: the embedded model (the
default), a Hugging Face folder (`--model PATH`), or a published model's shape with dummy weights (`--like NAME`,
or `--model` naming a folder `tandem make-model --like` wrote).

A model with weights is compared with transformers on those weights. A shape without weights runs tandem with
load_format dummy and transformers built from the same config.json with its own random weights: speed does not
depend on the values, and both are run with ignore_eos / min_new_tokens so neither stops early.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelChoice:
    """path: what load_model takes (None: the embedded model); load_format: "auto" or "dummy"; label: for the
    JSON (the embedded model, a folder, or the published name)."""

    path: str | None
    load_format: str
    label: str

    def load_args(self) -> dict:
        """load_model's arguments for this model (besides dtype, device and weight format)."""
        return {"path": self.path, "load_format": self.load_format}

    def transformers_model(self, dtype: torch.dtype, device: str = "cpu"):
        """The transformers peer in eval mode on device: the same weights, or (dummy) the same config with
        transformers' own random initialisation."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.path is None:
            from tandem.engine.loader import default_model_path

            gguf = default_model_path()
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        elif self.load_format == "dummy":
            config = AutoConfig.from_pretrained(self.path)
            torch.manual_seed(0)
            with torch.device(device):  # initialised where it runs: an 8B model's random init on the host is slow
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype)
        return model.to(device).eval()


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--model", default=None, help="a Hugging Face folder (default: the embedded model); a folder "
                      "from `tandem make-model --like` runs with dummy weights")
    what.add_argument("--like", default=None, metavar="NAME",
                      help="a published model's shape with dummy weights (e.g. Llama-3.2-1B; tandem make-model --like)")


def model_choice(args: argparse.Namespace) -> ModelChoice:
    """The ModelChoice that --model / --like name (see add_model_arguments). Raises ValueError for an unknown
    published name."""
    from tandem.engine.loader import load_model_info
    from tandem.engine.loader.published_models import MADE_BY, find_published, write_published_shape

    if args.like is not None:
        hub = find_published(args.like)
        scratch = tempfile.mkdtemp(prefix="tandem-like-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        folder = Path(scratch) / hub.split("/")[1]
        write_published_shape(hub, folder, load_model_info(None).tokenizer)
        return ModelChoice(str(folder), "dummy", f"{hub} (dummy weights)")
    if args.model is not None:
        folder = Path(args.model)
        if (folder / MADE_BY).is_file():
            return ModelChoice(str(folder), "dummy", f"{folder} (dummy weights)")
        return ModelChoice(str(folder), "auto", str(folder))
    return ModelChoice(None, "auto", "embedded SmolLM2-135M-Instruct")
