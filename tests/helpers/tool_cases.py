"""Two tools, their schemas and a tiny template that renders them: the tool-calling cases of the API tests
(tests/chat/test_tools.py) and the server tests (tests/serve/test_serve_tools.py) (test-only helper)."""

# a tiny template that renders tools (HF's ``tools`` variable), assistant tool_calls and tool results
TEMPLATE = ("{% if tools %}<|user|>tools: {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<|user|>{{ m.role }}: {{ m.content }}"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
            "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
THINKING = TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "Weather in Paris?"}]
# a Qwen3-Thinking-style template: its generation prompt opens <think> (the reply starts inside the reasoning)
OPENS_THINK = TEMPLATE + "{% if add_generation_prompt %}<think>\n{% endif %}{# </think> #}"
CITY = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def tool_loop_llm(call: str, answer: str):
    """A fake-backend model that writes ``call`` (text), and ``answer`` once the prompt holds a tool result
    ("tool: ..."), each ended by eos 0: an agent's loop of one call and its answer."""
    import numpy as np
    from fake_backend import make_llm, make_tokenizer

    tok = make_tokenizer()
    call_ids, answer_ids = tok.encode(call).ids + [0], tok.encode(answer).ids + [0]

    def rule(history: np.ndarray) -> int:
        start = int(np.flatnonzero(history == 2)[-1]) + 1  # after the last <|assistant|>
        script = answer_ids if "tool: " in tok.decode(history[:start].tolist()) else call_ids
        return script[min(len(history) - start, len(script) - 1)]

    return make_llm(tok, eos=(0,), chat_template=TEMPLATE, max_seq=1024, rule=rule)
