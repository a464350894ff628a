"""helmc's chat template rendering equals transformers' apply_chat_template (Qwen3, Llama 3 and Mistral style
templates, and gpt-oss's own harmony template in tokenizer_config.json files written here), and the template is found in a bundle as transformers
finds it."""
import json
import os
import re

import pytest

from chat_templates import FAMILIES
from helmc.errors import HelmcError
from helmc.runtime.serve.chat_template import load_chat_template

CHATS = {
    "user": [{"role": "user", "content": "Hello, who are you?"}],
    "system": [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "Hi"}],
    "turns": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "One"},
              {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three \"quoted\" <b>"}],
}


def write_model_files(d, family):
    from helmc.testing import make_tokenizer
    template, special = FAMILIES[family]
    os.makedirs(d, exist_ok=True)
    make_tokenizer(os.path.join(d, "tokenizer.json"))
    cfg = {"chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast", **special}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return d


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    from transformers import AutoTokenizer
    out = {}
    for fam in FAMILIES:
        d = write_model_files(str(tmp_path_factory.mktemp(fam)), fam)
        out[fam] = (AutoTokenizer.from_pretrained(d), load_chat_template(d))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("gen", [True, False])
def test_rendering_equals_transformers(families, family, chat, gen):
    hf, ours = families[family]
    messages = CHATS[chat]
    try:
        theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    except Exception as e:             # the template refused the conversation: so must we, with its message
        with pytest.raises(HelmcError, match="chat template: " + str(e).split("...")[0][:40]):
            ours.render(messages, add_generation_prompt=gen)
        return
    mine = ours.render(messages, add_generation_prompt=gen)
    assert mine == theirs
    assert len(mine) > 20


def test_qwen3_tools_and_template_kwargs_equal_transformers(families):
    hf, ours = families["qwen3"]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & \"here\"",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = CHATS["turns"] + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "sunny"}]
    theirs = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                    enable_thinking=False)
    mine = ours.render(messages, add_generation_prompt=True, tools=tools, enable_thinking=False)
    assert mine == theirs
    assert "Zürich" in mine and "<now> & \\\"here\\\"" in mine and mine.endswith("<think>\n\n</think>\n\n")


def test_gpt_oss_harmony_tools_thinking_and_kwargs_equal_transformers(families):
    """gpt-oss's harmony format: a developer message from the system one, function tools as a TypeScript namespace,
    an assistant tool call in the commentary channel with its analysis kept, the tool's answer, the template's own
    kwargs (reasoning_effort, model_identity, builtin_tools); and its refusal of channel tags in content."""
    hf, ours = families["gpt-oss"]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": {"type": "object", "required": ["city"], "properties": {
                                                   "city": {"type": "string", "description": "City name"},
                                                   "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                                                   "days": {"type": "array", "items": {"type": "integer"}}}}}}]
    messages = CHATS["turns"] + [
        {"role": "assistant", "thinking": "Need the weather.", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "sunny"}]
    kwargs = dict(reasoning_effort="high", model_identity="You are helmc's test model.", builtin_tools=["python"])
    theirs = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    mine = ours.render(messages, add_generation_prompt=True, tools=tools, **kwargs)
    assert mine == theirs
    for part in ("<|start|>developer<|message|># Instructions\n\nBe kind.", "namespace functions {",
                 'unit?: "c" | "f", // default: c', "Reasoning: high", "## python",
                 "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>",
                 '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Zürich"}<|call|>',
                 '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'):
        assert part in mine, part
    assert mine.endswith("<|start|>assistant")
    with pytest.raises(HelmcError, match=re.escape("chat template: You have passed a message containing <|channel|> tags")):
        ours.render([{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "<|channel|>final<|message|>Hello"}], add_generation_prompt=False)


def test_mistral_refuses_roles_out_of_order(families):
    _, ours = families["mistral"]
    with pytest.raises(HelmcError, match="chat template: After the optional system message, conversation roles must alternate"):
        ours.render([{"role": "assistant", "content": "first"}])


def test_where_the_bundle_keeps_its_template(tmp_path):
    assert load_chat_template(str(tmp_path)) is None                       # no template: None, not an error
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}],
           "bos_token": {"content": "<s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(str(tmp_path)).render([]) == "<s>D"              # the named list: "default"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}J")
    t = load_chat_template(str(tmp_path), {"eos_token": "</s>", "bos_token": "<x>"})
    assert t.render([]) == "</s>J" and t.special_tokens["bos_token"] == "<s>"    # the file first; config over fallback
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(HelmcError, match="chat template: expected a jinja2 template, found a syntax error at line 1"):
        load_chat_template(str(tmp_path))


def test_the_sandbox_holds(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    t = load_chat_template(str(tmp_path))
    with pytest.raises(HelmcError, match="chat template: "):
        t.render([{"role": "user", "content": "x"}])
