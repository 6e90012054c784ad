"""Tiny random-config models and helpers for the adapter, bench and model tests."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma3TextModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    RobertaConfig,
)

from attnstore_client.models import LoadedModel, resolve_model_path

TinyKind = Literal["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "embeddinggemma", "bert", "roberta",
                   "xlm-roberta", "distilbert", "mpnet", "modernbert"]

VOCAB = 96
FIRST_REAL_ID = 5  # below: pad/special ids (RoBERTa pads with 1)

_DECODER_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: 2 query heads per KV head
    "max_position_embeddings": 256,
}
_ENCODER_SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}


def gemma3_shape(hidden: int, heads: int, layers: int, *, bidirectional: bool = False) -> dict[str, Any]:
    """What a tiny Gemma 3 config sets beyond the common shape: sliding layers (a window shorter than the test rows)
    alternating with full ones, a score scale that is not ``head_dim ** -0.5``, and ``use_bidirectional_attention``
    for an EmbeddingGemma-shaped model (whose config then halves the window: ``(6 // 2) + 1`` on both sides)."""
    return {"head_dim": hidden // heads,  # Gemma 3's config says 256 unless told
            "sliding_window": 6, "query_pre_attn_scalar": 12,
            "layer_types": [("sliding_attention", "full_attention")[layer % 2] for layer in range(layers)],
            "use_bidirectional_attention": bidirectional}


def tiny_model(kind: TinyKind, *, attn_implementation: str = "sdpa", seed: int = 0) -> LoadedModel:
    """A random tiny model of that kind, fp32, eval mode, without a tokenizer (``embeddinggemma``: a bidirectional
    ``gemma3_text`` model without its LM head)."""
    torch.manual_seed(seed)
    if kind in ("gemma3_text", "embeddinggemma"):
        shape = _DECODER_SHAPE
        config = Gemma3TextConfig(**shape, **gemma3_shape(shape["hidden_size"], shape["num_attention_heads"],
                                                          shape["num_hidden_layers"],
                                                          bidirectional=kind == "embeddinggemma"),
                                  attn_implementation=attn_implementation)
        if kind == "embeddinggemma":
            encoder = Gemma3TextModel(config).eval()
            _random_gemma_norms(encoder)
            return LoadedModel(name=kind, model=encoder, tokenizer=None, lm_head=None)
        gemma = Gemma3ForCausalLM(config).eval()
        _random_gemma_norms(gemma)
        return LoadedModel(name=kind, model=gemma.get_decoder(), tokenizer=None, lm_head=gemma.lm_head)
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        config_cls, model_cls = {
            "llama": (LlamaConfig, LlamaForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        }[kind]
        # A window shorter than the test rows, so capture must honour it.
        extra: dict[str, Any] = {"sliding_window": 6} if kind == "mistral" else {}
        if kind == "qwen3":
            extra["head_dim"] = _DECODER_SHAPE["hidden_size"] // _DECODER_SHAPE["num_attention_heads"]  # else 128
        config = config_cls(**_DECODER_SHAPE, **extra, attn_implementation=attn_implementation)
        causal_lm = model_cls(config).eval()
        if kind == "qwen3":
            _random_head_norms(causal_lm)
        return LoadedModel(name=kind, model=causal_lm.get_decoder(), tokenizer=None, lm_head=causal_lm.lm_head)
    if kind in ("bert", "roberta"):
        config_cls = BertConfig if kind == "bert" else RobertaConfig
        extra = {"pad_token_id": 1} if kind == "roberta" else {}
        config = config_cls(**_ENCODER_SHAPE, **extra, attn_implementation=attn_implementation)
    else:
        extra = {"pad_token_id": pad_id(kind)}
        if kind == "distilbert":
            extra["hidden_dim"] = _ENCODER_SHAPE["intermediate_size"]  # its feed-forward width's own name
        if kind == "mpnet" and attn_implementation == "sdpa":
            attn_implementation = "eager"  # MPNet has no sdpa kernel in transformers
        if kind == "modernbert":
            extra.update(_MODERNBERT_LAYERS)
        config = AutoConfig.for_model(kind, **_ENCODER_SHAPE, **extra, attn_implementation=attn_implementation)
    model = AutoModel.from_config(config).eval()
    if kind == "mpnet":
        _strong_position_bias(model)
    if kind == "modernbert":
        _sharp_attention(model)
    return LoadedModel(name=kind, model=model, tokenizer=None, lm_head=None)


# ModernBERT's layers: global, local, global; a local layer's window (3 tokens each side) shorter than the test rows,
# so capture, replay and packed forwards must honour it. Its special ids inside the tiny vocabulary.
_MODERNBERT_LAYERS = {"global_attn_every_n_layers": 2, "local_attention": 6, "cls_token_id": 2, "bos_token_id": 2,
                      "sep_token_id": 3, "eos_token_id": 3}


def _sharp_attention(model: Any) -> None:
    """ModernBERT's fused q/k/v projections drawn large (its initialisation leaves every map nearly uniform): a map
    that drops or misplaces its window, or a rotary table of the wrong theta, replays a visibly different row."""
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.Wqkv.weight.normal_(0.0, 0.2)


def _strong_position_bias(model: Any) -> None:
    """MPNet's relative position bias as large as the scores (random init leaves it near 0): a forward, capture or
    replay that drops or misplaces it is visibly wrong."""
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)


def _random_head_norms(model: Any) -> None:
    """Qwen3's query and key norms with weights far from their initial ones: a capture, replay or fused forward that
    drops a norm is visibly wrong."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.normal_(1.0, 0.5)


def _random_gemma_norms(model: Any) -> None:
    """Every Gemma3RMSNorm's weight off its initial zeros (the norm scales by ``1 + weight``): a capture, replay or
    embedding layer that drops a norm, or takes its weight for Llama's, is visibly wrong."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.5)


def pad_id(kind: TinyKind) -> int:
    """The pad id a tiny model of that kind expects (RoBERTa's and XLM-RoBERTa's number positions from it; MPNet's
    embeddings always take 1)."""
    return 1 if kind in ("roberta", "xlm-roberta", "mpnet") else 0


def random_rows(lengths: list[int], *, seed: int = 1) -> list[list[int]]:
    """Random token id rows of the given lengths, avoiding the special ids."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_REAL_ID, VOCAB, (length,), generator=generator).tolist() for length in lengths]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference of two same-shape tensors."""
    return (a - b).abs().max().item()


def save_tiny_decoder(folder: Path, *, full_vocab: bool = False) -> Path:
    """Save a tiny random Llama as a local Hugging Face folder, with MiniLM's tokenizer files.

    ``full_vocab``: a vocabulary as large as that tokenizer's (30,522), so any real text fits it.
    """
    tiny = tiny_model("llama")
    config = copy.deepcopy(tiny.model.config)  # tiny_model's own stays as it is
    if full_vocab:
        config.vocab_size = 30522
    causal_lm = LlamaForCausalLM(config)
    causal_lm.save_pretrained(folder)
    tokenizer_source = resolve_model_path("minilm")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tokenizer_source / name, folder / name)
    return folder


def save_tiny_family(family: str, folder: Path, *, hidden: int = 32, padding_side: str = "right",
                     pooling: str | None = None, causal_lm: bool = False, bidirectional: bool = False,
                     dense: tuple[int, ...] = ()) -> Path:
    """A random tiny model of ``family`` (any ``model_type`` transformers knows) with all-MiniLM-L6-v2's tokenizer
    (its whole vocabulary), saved as a transformers folder; with ``pooling``, as a sentence-transformers folder of
    that model, a ``Pooling`` of that mode, a ``Dense`` layer (identity activation) of each width in ``dense`` and
    ``Normalize``, its tokenizer padding on ``padding_side``; with ``causal_lm`` (a decoder family, no ``pooling``),
    the model with its LM head (``AutoModelForCausalLM``). ``bidirectional`` (``gemma3_text``): the config's
    ``use_bidirectional_attention``, as EmbeddingGemma's (with ``pooling="mean"``, ``dense=(64, 32)``: its
    pipeline's shape)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    shape: dict[str, Any] = {"vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 48,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 160}
    if family in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text"):
        shape["num_key_value_heads"] = 2
    if family == "gemma3_text":
        shape.update(gemma3_shape(hidden, shape["num_attention_heads"], shape["num_hidden_layers"],
                                  bidirectional=bidirectional))
    if family == "qwen3":
        shape["head_dim"] = hidden // shape["num_attention_heads"]  # Qwen3's config says 128 unless told
    if family == "mistral":
        shape["sliding_window"] = 6  # shorter than most rows: the window matters
    if family in ("roberta", "xlm-roberta"):
        shape["pad_token_id"] = tokenizer.pad_token_id  # RoBERTa numbers positions from its pad id
    if family == "mpnet":
        # MPNet's embeddings number positions from pad id 1 whatever the config says: the tokenizer pads with 1.
        shape["pad_token_id"] = 1
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(1)
    if family == "distilbert":
        shape["hidden_dim"] = shape["intermediate_size"]  # its feed-forward width's own name
    if family == "modernbert":
        # Its config's special ids are its own tokenizer's (50,28x): MiniLM's instead; a window shorter than most rows.
        shape.update(pad_token_id=tokenizer.pad_token_id, cls_token_id=tokenizer.cls_token_id,
                     bos_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id,
                     eos_token_id=tokenizer.sep_token_id, global_attn_every_n_layers=2, local_attention=8)
    torch.manual_seed(len(family))
    model_cls = AutoModelForCausalLM if causal_lm else AutoModel
    model = model_cls.from_config(AutoConfig.for_model(family, **shape)).eval()
    if family == "mpnet":
        _strong_position_bias(model)
    if family == "qwen3":
        _random_head_norms(model)
    if family == "modernbert":
        _sharp_attention(model)
    if family == "gemma3_text":
        _random_gemma_norms(model)
    transformers_folder = folder if pooling is None else folder / "transformer"
    model.save_pretrained(transformers_folder)
    tokenizer.padding_side = padding_side
    tokenizer.save_pretrained(transformers_folder)
    if pooling is not None:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer import modules

        transformer = modules.Transformer(str(transformers_folder))
        layers: list[torch.nn.Module] = [transformer, modules.Pooling(hidden, pooling_mode=pooling)]
        for width, out in zip((hidden, *dense), dense, strict=False):
            layers.append(modules.Dense(width, out, bias=False, activation_function=torch.nn.Identity()))
        pipeline = SentenceTransformer(modules=[*layers, modules.Normalize()], device="cpu")
        pipeline.save(str(folder))
    return folder


def save_tiny_cross_encoder(folder: Path, family: str, labels: int) -> Path:
    """A tiny random ``*ForSequenceClassification`` of ``family`` with all-MiniLM-L6-v2's tokenizer, saved."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    shape = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 160, "num_labels": labels}
    if family == "qwen3":
        shape.update(num_key_value_heads=2, head_dim=8, pad_token_id=tokenizer.pad_token_id)
    if family == "distilbert":
        shape.update(dim=32, hidden_dim=48, n_layers=2, n_heads=4)
    torch.manual_seed(labels + len(family))
    model = AutoModelForSequenceClassification.from_config(AutoConfig.for_model(family, **shape)).eval()
    with torch.no_grad():  # a head of random weights larger than its initialisation: scores that differ
        for parameter in model.parameters():
            parameter.mul_(3.0) if parameter.ndim == 2 else None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
