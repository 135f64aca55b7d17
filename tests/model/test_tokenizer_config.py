"""tokenizer_config.json: add_bos_token / add_eos_token decide what encode adds (over the tokenizer.json
post-processor), bad fields are ConfigErrors naming the file, settings survive save_pretrained; chat templates
render as transformers renders them (jinja2 sandbox, raise_exception, bos_token) and model.chat continues the
rendered prompt."""

import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from metrale_jax.builtin import builtin_model_dir
from metrale_jax.chat import apply_chat_template
from metrale_jax.errors import ConfigError
from metrale_jax.model import NemotronH
from metrale_jax.tokenizer import ByteTokenizer, TokenizerSettings, load_tokenizer, read_tokenizer_settings

# a Zephyr-like template: role markers, the BOS string first, raise_exception on a bad role
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
            "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _word_level_with_bos(d):
    """A WordLevel tokenizer.json whose post-processor adds <s> in front (as many HF tokenizers do)."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "the": 4, "cat": 5, "sat": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))


@pytest.mark.parametrize("config, want", [
    (None, [1, 4, 5]),                                           # the post-processor decides
    ({"add_bos_token": False}, [4, 5]),
    ({"add_bos_token": True, "add_eos_token": True}, [1, 4, 5, 2]),
    ({"add_bos_token": False, "add_eos_token": True}, [4, 5, 2]),
])
def test_add_bos_and_eos_token_decide_over_the_post_processor(tmp_path, config, want):
    _word_level_with_bos(tmp_path)
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("the cat") == want
    assert tok.encode("the cat", add_bos=False) == [4, 5]


def test_byte_model_settings_change_scores_and_survive_save_pretrained(tmp_path):
    src = builtin_model_dir()
    d = tmp_path / "m"
    shutil.copytree(src, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "chat_template": TEMPLATE,
                                                         "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    model = NemotronH.from_pretrained(d, dtype=np.float32)
    assert model.tokenizer.encode("ab") == [100, 101] and model.tokenizer.chat_template == TEMPLATE
    assert model.tokenizer.settings.bos_token == "<s>"
    model.save_pretrained(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again == model.tokenizer and again != ByteTokenizer()
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    for field, value in (("add_bos_token", "yes"), ("chat_template", 5), ("eos_token", 3),
                         ("chat_template", [{"name": ["default"], "template": "x"}, {"name": "default", "template": 5}])):
        (bad / "tokenizer_config.json").write_text(json.dumps({field: value}))
        with pytest.raises(ConfigError, match=f"tokenizer_config.json: {field}"):
            load_tokenizer(bad)


def test_chat_template_renders_and_model_chat_continues_it(tmp_path):
    tok = ByteTokenizer(TokenizerSettings(chat_template=TEMPLATE, bos_token="<s>", eos_token="</s>"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who wept?"}]
    text = apply_chat_template(tok, messages)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nWho wept?</s>\n<|assistant|>\n"
    assert apply_chat_template(tok, messages, add_generation_prompt=False) == text[:-len("<|assistant|>\n")]
    with pytest.raises(ConfigError, match="messages: unknown role robot"):
        apply_chat_template(tok, [{"role": "robot", "content": "hi"}])
    with pytest.raises(ConfigError, match="messages"):
        apply_chat_template(tok, "Who wept?")
    with pytest.raises(ConfigError, match=r"messages: messages\[0\]: expected a dict with a string 'role'"):
        apply_chat_template(tok, [{"role": 10 ** 5000, "content": "hi"}])     # an int repr refuses to show
    reads = ByteTokenizer(TokenizerSettings(chat_template="{{ messages[0]['name'].upper() }}"))
    with pytest.raises(ConfigError, match="messages: the chat template cannot render these messages: UndefinedError"):
        apply_chat_template(reads, messages)                              # a key the messages lack
    with pytest.raises(ConfigError, match="chat_template: this model's tokenizer has no chat template"):
        apply_chat_template(ByteTokenizer(), messages)
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
    d = tmp_path / "m"
    shutil.copytree(builtin_model_dir(), d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": named, "bos_token": "<s>",
                                                         "eos_token": "</s>"}))
    model = NemotronH.from_pretrained(d, dtype=np.float32)
    assert model.apply_chat_template(messages) == text                 # the 'default' of a list of templates
    reply = model.chat(messages, max_new_tokens=6)
    want = model.generate([model.tokenizer.encode(text, add_bos=False)], max_new_tokens=6)[0]
    assert reply.tokens == want.tokens and reply.text == model.tokenizer.decode(want.tokens)


def test_a_list_of_named_chat_templates_gives_the_last_default(tmp_path):
    """transformers' rule: the templates by name, a later one of the same name winning; entries that are not
    {"name", "template"} objects (a list as a name, a string) are passed over, never a TypeError."""
    templates = ["junk", {"name": ["default"], "template": "no"}, {"name": "default", "template": "first"},
                 {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "last"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert read_tokenizer_settings(tmp_path).chat_template == "last"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates[:2]}))
    assert read_tokenizer_settings(tmp_path).chat_template is None


def test_a_byte_tokenizer_file_with_other_ids_is_named_by_its_path(tmp_path):
    shutil.copytree(builtin_model_dir(), tmp_path / "m")
    (tmp_path / "m" / "byte_tokenizer.json").write_text(json.dumps({"type": "bytes", "pad_id": [0]}))
    with pytest.raises(ConfigError, match="unsupported byte tokenizer settings") as e:
        load_tokenizer(tmp_path / "m")
    assert e.value.field == str(tmp_path / "m" / "byte_tokenizer.json")
