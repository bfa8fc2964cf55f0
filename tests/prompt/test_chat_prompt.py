"""The engine's chat prompts: incremental across an agent's turns (tools, calls, results,
a continued final message), always the ids a whole render and encode gives."""

from __future__ import annotations

import random

from agentserve.prompt.chat import ChatPrompts, chat_messages
from agentserve.api.openai import FunctionCall, Message, MessageToolCall
from agentserve.engine.model.tiny import default_model_dir
from agentserve.prompt.tokenizer import Tokenizer, continue_final

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]


def test_turns_tokenize_incrementally_to_the_whole_encoding() -> None:
    tok = Tokenizer.from_dir(default_model_dir())
    cp = ChatPrompts(tok)
    rng = random.Random(3)
    words = ["def", "return", "é", "😀", "{", "}", "\n", "fix", "the", "bug", "<tool_call>"]
    msgs = [Message(role="system", content="You are a coding agent. " * 100)]
    for turn in range(6):
        msgs.append(Message(role="user", content=" ".join(rng.choice(words) for _ in range(200))))
        dicts = chat_messages(msgs)
        whole = tok.encode(tok.apply_chat_template(dicts, tools=TOOLS))
        assert cp.ids(dicts, TOOLS) == whole, turn
        call = MessageToolCall(id=f"c{turn}", function=FunctionCall(name="bash",
                                                                   arguments={"cmd": "ls"}))
        msgs += [Message(role="assistant", content="", tool_calls=[call]),
                 Message(role="tool", tool_call_id=f"c{turn}", content="a.py b.py " * 30)]
    assert cp.inc.renders["incremental"] >= 4  # later turns tokenized only what they added
    dicts = chat_messages([*msgs, Message(role="assistant", content="The answer is")])
    want = tok.encode(continue_final(tok.apply_chat_template(dicts, tools=TOOLS,
                                                             add_generation_prompt=False),
                                     "The answer is"))
    assert cp.ids(dicts, TOOLS, add_generation_prompt=False, continue_final_message=True) == want


def test_completion_text_prompts_tokenize_incrementally_per_session() -> None:
    tok = Tokenizer.from_dir(default_model_dir())
    cp = ChatPrompts(tok)
    text = "def f(x):\n    return x + 1\n" * 400 + "é😀"
    for turn in range(4):
        assert cp.text_ids(text, True, "s1") == tok.encode(text, True), turn
        text += f"\n# turn {turn}: fix the bug\n" * 5
    # (a different session with the same head still finds it)
    assert cp.text_ids(text + "x", False, "s2") == tok.encode(text + "x", False)
