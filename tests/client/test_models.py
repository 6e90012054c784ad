"""Loading models offline: packaged aliases, local folders, clear errors for the rest."""

from __future__ import annotations

import pytest
import torch
from transformers import BertModel, GPT2Model, LlamaModel

from attnstore.errors import ConfigError
from attnstore_client.models import MODEL_ALIASES, load_model, resolve_model_path
from tests.support.adapters import save_tiny_decoder, save_tiny_family


def test_aliases_resolve_to_the_packaged_files():
    assert set(MODEL_ALIASES) == {"minilm", "smollm2"}
    assert (resolve_model_path("minilm") / "config.json").is_file()
    assert resolve_model_path("smollm2").suffix == ".gguf" and resolve_model_path("smollm2").is_file()


def test_unknown_alias_names_the_aliases():
    with pytest.raises(ConfigError, match=r"'nope'.*\['minilm', 'smollm2'\]"):
        load_model("nope")


def test_bad_attention_implementation_names_the_choices():
    with pytest.raises(ConfigError, match=r"'flash'.*\['sdpa', 'eager'\]"):
        load_model("minilm", attn_implementation="flash")


def test_an_architecture_without_an_adapter_loads_as_a_decoder_with_its_head(tmp_path):
    save_tiny_family("gpt2", tmp_path)  # issue 49 item 2: no adapter means slower, never refused
    loaded = load_model(str(tmp_path))
    assert isinstance(loaded.model, GPT2Model) and not loaded.model.training and loaded.lm_head is not None


def test_local_decoder_folder_loads_base_model_and_head(tmp_path):
    loaded = load_model(str(save_tiny_decoder(tmp_path)), attn_implementation="eager")
    assert isinstance(loaded.model, LlamaModel) and not loaded.model.training
    assert loaded.model.config._attn_implementation == "eager"
    assert loaded.lm_head is not None and loaded.lm_head.out_features == loaded.model.config.vocab_size


@pytest.mark.real_model
def test_minilm_loads_as_fp32_bert_encoder_without_head(minilm_model):
    assert isinstance(minilm_model.model, BertModel) and not minilm_model.model.training
    assert minilm_model.model.dtype == torch.float32 and minilm_model.lm_head is None
    assert minilm_model.model.config._attn_implementation == "sdpa"


@pytest.mark.real_model
def test_smollm2_loads_as_fp32_llama_decoder_with_head_and_pad_token(smollm2_model):
    config = smollm2_model.model.config
    assert isinstance(smollm2_model.model, LlamaModel) and smollm2_model.model.dtype == torch.float32
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert smollm2_model.lm_head is not None and smollm2_model.tokenizer.pad_token_id is not None


@pytest.mark.real_model
def test_a_gguf_file_is_dequantised_once_into_a_folder_that_loads_the_same_model(tmp_path):
    from attnstore_client.keys import model_fingerprint

    unwritable = tmp_path / "a-file"
    unwritable.write_bytes(b"")  # a cache that cannot be made: the GGUF file itself is read
    direct = load_model("smollm2", model_cache=unwritable)
    cached = load_model("smollm2", model_cache=tmp_path / "cache")
    (folder,) = (tmp_path / "cache").iterdir()
    written = (folder / "model.safetensors").stat().st_mtime_ns
    again = load_model("smollm2", model_cache=tmp_path / "cache")
    assert (folder / "model.safetensors").stat().st_mtime_ns == written  # read, not converted again
    assert model_fingerprint(cached.model, cached.tokenizer) == model_fingerprint(direct.model, direct.tokenizer)
    assert model_fingerprint(again.model, again.tokenizer) == model_fingerprint(direct.model, direct.tokenizer)
    text = "Quick  brown fox, naïve café — 42 tokens?\nthe end"
    assert cached.tokenizer(text)["input_ids"] == direct.tokenizer(text)["input_ids"]
    assert cached.tokenizer.pad_token_id == direct.tokenizer.pad_token_id
    ids = torch.tensor([direct.tokenizer(text)["input_ids"]])
    with torch.inference_mode():
        expected = direct.lm_head(direct.model(input_ids=ids).last_hidden_state)
        assert torch.equal(cached.lm_head(cached.model(input_ids=ids).last_hidden_state), expected)
