"""Models of the packaged models' shapes for ``attnstore bench gpu``: carried without weights, given seeded random
weights where they run.

Real weights do not fit the carry (all-MiniLM-L6-v2 in fp16 is 45 MB, SmolLM2-135M 270 MB, against 64 MiB for
everything), so ``--prepare`` writes each model's configuration and tokenizer (and MiniLM's sentence-transformers
modules) and a ``weights.json`` that says the weights are random and from which seed; the run draws them with
that seed into a scratch folder. Timings depend on shapes only; the GPU tests compare the GPU path with the CPU
path on the same weights, so random ones serve, and the output says so.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from attnstore.errors import ConfigError

FAMILIES = {"minilm": "bert", "smollm2": "llama"}  # the packaged models whose shapes travel, by alias
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHTS_FILE = "weights.json"


@dataclass(frozen=True, slots=True)
class PreparedModel:
    """A model folder ready to load."""

    alias: str  # minilm or smollm2
    family: str  # bert or llama
    path: Path
    weights: str  # "random (seed N)" or "real"


def prepare_models(dest: Path, *, seed: int = 0) -> list[Path]:
    """Write each packaged model's configuration and tokenizer, without weights, under ``dest/<alias>``.

    Raises:
        ConfigError: a packaged model is not installed here.
    """
    from attnstore_client.models import resolve_model_path

    shutil.rmtree(dest, ignore_errors=True)
    folders = []
    for alias, family in FAMILIES.items():
        folder = dest / alias
        source = resolve_model_path(alias)
        if source.is_dir():  # MiniLM: a sentence-transformers folder; everything but the weights
            shutil.copytree(source, folder, ignore=shutil.ignore_patterns(*_WEIGHT_FILES, "README.md"))
        else:  # SmolLM2: a GGUF file; its configuration and tokenizer as a Hugging Face folder
            from transformers import AutoConfig, AutoTokenizer

            kwargs = {"gguf_file": source.name, "local_files_only": True}
            AutoConfig.from_pretrained(source.parent, **kwargs).save_pretrained(folder)
            AutoTokenizer.from_pretrained(source.parent, **kwargs).save_pretrained(folder)
        (folder / WEIGHTS_FILE).write_text(json.dumps({"weights": "random", "seed": seed, "family": family}) + "\n",
                                           encoding="utf-8")
        folders.append(folder)
    return folders


def materialize(carried: Path, scratch: Path) -> list[PreparedModel]:
    """Each carried model as a loadable folder under ``scratch``: its files and weights drawn with its seed.

    Raises:
        ConfigError: ``carried`` holds no prepared model (run ``gpu_check.sh --prepare``).
    """
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    models = []
    for alias, family in FAMILIES.items():
        source = carried / alias
        spec_path = source / WEIGHTS_FILE
        if not spec_path.is_file():
            raise ConfigError(f"bench gpu: no prepared model in {source}: run scripts/gpu_check.sh --prepare")
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
        folder = scratch / alias
        if not (folder / "model.safetensors").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(source, folder)
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(spec["seed"]))
                model = (AutoModelForCausalLM if family == "llama" else AutoModel).from_config(config)
            model.save_pretrained(folder)
        models.append(PreparedModel(alias, family, folder, f"random (seed {spec['seed']})"))
    return models
