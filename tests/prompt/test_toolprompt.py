"""Tools on a chat template that has none: the Hermes/Qwen block in the system message, tool
history as text; templates that render tools are left alone; incremental = full ids."""

from __future__ import annotations

import json

from agentserve.prompt.incremental import IncrementalTokenizer
from agentserve.prompt.tokenizer import Tokenizer
from agentserve.prompt.toolprompt import hermes_messages, renders_tools

# SmolLM2-135M-Instruct's template (as in its GGUF): no tools, a default system prompt
SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are SmolLM<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": {"city": "Paris"}}}


def smol(tokenizer: Tokenizer) -> Tokenizer:
    return Tokenizer(tokenizer.hf, {**tokenizer.config, "chat_template": SMOL})


def test_detection(tokenizer: Tokenizer, tiny_tokenizer: Tokenizer) -> None:
    s = smol(tokenizer)
    assert not renders_tools(s.chat_template, s._template)
    assert renders_tools(tiny_tokenizer.chat_template, tiny_tokenizer._template)
    assert renders_tools(tokenizer.chat_template, tokenizer._template)  # conftest's CHATML


def test_block_in_system_message(tokenizer: Tokenizer) -> None:
    s = smol(tokenizer)
    user = [{"role": "user", "content": "weather?"}]
    text = s.apply_chat_template(user, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools")  # a new system message
    assert json.dumps(TOOLS[0]) in text and "<tool_call>" in text
    assert "You are SmolLM" not in text
    text = s.apply_chat_template([{"role": "system", "content": "be brief"}, *user], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools")  # merged
    assert text.count("<|im_start|>system") == 1
    assert s.apply_chat_template(user) == s.apply_chat_template(user, tools=None)
    assert "You are SmolLM" in s.apply_chat_template(user)  # no tools: as before


def test_history_as_text(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "c1"}]
    out = hermes_messages(msgs, None)
    assert out[1] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                      '"arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[2] == {"role": "user", "content": '<tool_response>\n{"temp": 20}\n</tool_response>'}
    assert msgs[1]["tool_calls"] == [CALL]  # the caller's messages are not changed
    text = smol(tokenizer).apply_chat_template(msgs, tools=TOOLS)
    assert "<|im_start|>tool" not in text and "get_weather\", \"arguments\": {\"city\"" in text


def test_template_with_tools_unchanged(tiny_tokenizer: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "weather?"}]
    text = tiny_tokenizer.apply_chat_template(msgs, tools=TOOLS)
    assert text == tiny_tokenizer._template.render(messages=msgs, tools=TOOLS,
                                                   add_generation_prompt=True, bos_token="",
                                                   eos_token=tiny_tokenizer.eos_token or "")


def test_incremental_equals_full(tokenizer: Tokenizer) -> None:
    s = smol(tokenizer)
    inc = IncrementalTokenizer(s)
    msgs: list[dict] = [{"role": "user", "content": "weather in Paris?"}]
    for turn in range(5):
        ids = inc.chat(msgs, tools=TOOLS).ids.tolist()
        assert ids == s.encode(s.apply_chat_template(msgs, tools=TOOLS))
        msgs = [*msgs, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": f'{{"temp": {turn}}}'},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"and {turn}?"}]
    assert inc.renders["incremental"] > 0
