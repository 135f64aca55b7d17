"""Tokenizers: the byte tokenizer, tokenizer.json through `tokenizers`, picking one from a model directory,
and a model that speaks strings."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from metrale_jax.config import ModelConfig
from metrale_jax.errors import ConfigError
from metrale_jax.model import NemotronH
from metrale_jax.tokenizer import BYTE_TOKENIZER_FILE, ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Héllo, wörld — ☃!"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 1 and (tok.pad_id, tok.eos_id, tok.vocab_size) == (0, 2, 259)
    assert ids[1:] == [b + 3 for b in text.encode("utf-8")]
    assert tok.decode(ids + [tok.eos_id, tok.pad_id, 400]) == text       # specials and strays skipped
    assert tok.encode("ab", add_bos=False) == [100, 101]
    assert tok.decode(tok.encode("é", add_bos=False)[:1]) == "\ufffd"     # broken UTF-8 is replaced


def _word_level(d):
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "the": 4, "cat": 5, "sat": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(d / "tokenizer.json"))


def test_hf_tokenizer_json(tmp_path):
    _word_level(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 0, 7)
    assert tok.encode("the cat sat dog") == [4, 5, 6, 3]
    assert tok.decode([4, 5, 2]) == "the cat"
    (tmp_path / "copy").mkdir()
    tok.save(tmp_path / "copy")
    assert load_tokenizer(tmp_path / "copy").encode("cat") == [5]


def test_load_tokenizer_picks_the_file_present(tmp_path):
    assert load_tokenizer(tmp_path) is None
    ByteTokenizer().save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    _word_level(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)            # tokenizer.json wins
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / BYTE_TOKENIZER_FILE).write_text(json.dumps({"type": "bytes", "offset": 4}))
    with pytest.raises(ConfigError, match="offset"):
        load_tokenizer(bad)
    (bad / "tokenizer.json").write_text("not json")
    with pytest.raises(ConfigError, match="tokenizer"):
        load_tokenizer(bad)


def test_a_byte_model_speaks_strings_and_keeps_its_tokenizer(tmp_path):
    cfg = ModelConfig.from_hf(dict(vocab_size=259, hidden_size=16, hybrid_override_pattern="*-",
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=24))
    model = NemotronH.from_config(cfg, jax.random.key(0), dtype=jnp.float32, tokenizer=ByteTokenizer())
    out = model.generate(["ab", "hello"], max_new_tokens=4)
    tok = ByteTokenizer()
    for prompt, g in zip(["ab", "hello"], out):
        assert g.text == tok.decode(g.tokens)
        logits = np.asarray(model.forward(np.array([tok.encode(prompt) + g.tokens])))[0]
        assert g.tokens == np.argmax(logits[len(prompt):], -1)[:len(g.tokens)].tolist()
    model.save_pretrained(tmp_path)
    again = NemotronH.from_pretrained(tmp_path, dtype=jnp.float32)
    assert isinstance(again.tokenizer, ByteTokenizer)
    assert [g.tokens for g in again.generate(["ab", "hello"], max_new_tokens=4)] == [g.tokens for g in out]
