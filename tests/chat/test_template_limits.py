"""Chat templates are code from a model file: rendering is bounded in time, output and value sizes
(runtime/chat/template_sandbox.py), ends in one line, and is safe from many threads at once."""

import threading
import time
import tracemalloc

import pytest

from decodert.errors import DecodertError
from decodert.runtime.chat.chat import render_chat
from decodert.runtime.chat.template_sandbox import Limits

MSGS = [{"role": "user", "content": "hi"}]
FAST = Limits(seconds=0.5)

BOMBS = {  # template -> what the message says
    "nested loops 10^10": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           "took more than 0.5 s"),
    "lipsum(1e8)": ("{{ lipsum(100000000) }}", "integer argument|lipsum|undefined"),
    "lipsum(5)": ("{{ lipsum(5) }}", "lipsum|undefined"),
    "string * 4e9": ("{{ 'a' * 4000000000 }}", "repeating a value"),
    "list * 1e5 of big strings": ("{{ ['a' * 1000] * 100000 }}", "repeating a value"),
    "doubling with ~": ("{% set ns = namespace(x='a') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}"
                        "{% endfor %}{{ ns.x|length }}", "a value larger than"),
    "doubling with +": ("{% set ns = namespace(x='a') %}{% for i in range(64) %}{% set ns.x = ns.x + ns.x %}"
                        "{% endfor %}", "joining two values"),
    "big power": ("{{ 7 ** 100000 }}", "larger than 4096 bits"),
    "% width": ("{{ '%999999999d' % 1 }}", "format string with a width"),
    "format filter width": ("{{ '%999999999d'|format(1) }}", "format string with a width"),
    "str.format width": ("{{ '{:>999999999}'.format(1) }}", "format string with a width"),
    "center(1e9)": ("{{ 'a'|center(1000000000) }}", "integer argument"),
    "ljust(1e9)": ("{{ 'a'.ljust(1000000000) }}", "integer argument"),
    "range(1e9)": ("{{ range(1000000000)|list|length }}", "integer argument|longer than"),
    "output 100 MB": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output is longer"),
    "join bomb": ("{{ range(100000)|join('x' * 100) }}", "a value larger than"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError|took more than"),
    "escape __globals__": ("{{ cycler.__init__.__globals__ }}", "unsafe"),
    "escape __subclasses__": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "escape attr filter": ("{{ ''|attr('__class__') }}", "unsafe"),
    "raise_exception": ("{{ raise_exception('nope') }}", "rejected the messages: nope"),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_template_bombs_end_in_one_line_quickly(name):
    template, match = BOMBS[name]
    tracemalloc.start()
    t0 = time.monotonic()
    with pytest.raises(DecodertError, match=match) as e:
        render_chat(template, MSGS, limits=FAST)
    seconds, peak = time.monotonic() - t0, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "\n" not in str(e.value)
    assert seconds < 10 and peak < 200 << 20, (seconds, peak)  # generous: shared CI cores


def test_real_templates_still_render():
    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    assert render_chat(chatml, MSGS) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tools = "{{ messages | tojson }}{% for i in range(messages|length) %}{{ loop.index }}{% endfor %}"
    assert render_chat(tools, [{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]1'
    long = [{"role": "user", "content": "x" * 1_000_000}]  # a 1 MB message is fine
    assert len(render_chat("{{ messages[0]['content'] }}", long)) == 1_000_000


def test_one_slow_template_does_not_hold_up_other_threads():
    bomb = BOMBS["nested loops 10^10"][0]
    good = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    results, errors = [], []

    def slow():
        try:
            render_chat(bomb, MSGS, limits=Limits(seconds=1.5))
        except DecodertError as e:
            errors.append(str(e))

    def fast(i):
        for _ in range(20):
            results.append(render_chat(good, [{"role": "user", "content": str(i)}]) == f"[{i}]")

    threads = [threading.Thread(target=slow)] + [threading.Thread(target=fast, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(30)
    done_while_bomb_ran = threads[0].is_alive()
    threads[0].join(30)
    assert results == [True] * 60 and len(errors) == 1 and "took more than 1.5 s" in errors[0]
    assert done_while_bomb_ran  # the good renders finished before the bomb's deadline
