"""Wrong types at the public API end in one DecodertError naming the argument (runtime/validate.py),
before any backend work; odd-but-valid values give the same result as their plain form."""


import numpy as np
import pytest

from fake_backend import make_llm  # noqa: E402

from decodert.errors import DecodertError  # noqa: E402
from decodert.runtime.llm import Request  # noqa: E402
from decodert.runtime.decoding.sampling import SamplingParams  # noqa: E402

BAD_CALLS = {
    "lone surrogate": (lambda llm: llm.generate("ab\ud800c"), "lone surrogate"),
    "int prompt": (lambda llm: llm.generate(5), "prompt is a int"),
    "bytes prompt": (lambda llm: llm.generate(b"text"), "prompt is bytes"),
    "bytearray prompt": (lambda llm: llm.generate(bytearray(b"\x05\x06")), "prompt is bytearray"),
    "float prompt": (lambda llm: llm.generate(1.5), "prompt is a float"),
    "float ids": (lambda llm: llm.generate([1.9, 2.7]), "item 0 is a float"),
    "mixed batch": (lambda llm: llm.generate(["hi", 5]), "item 1 is a int"),
    "bool ids": (lambda llm: llm.generate([True, 4]), "item 0 is a bool"),
    "id 2**64": (lambda llm: llm.generate([2**64]), "not below 2\\*\\*63"),
    "id 2**63": (lambda llm: llm.generate([5, 2**63]), "not below 2\\*\\*63"),
    "negative id": (lambda llm: llm.generate([5, -1]), "negative"),
    "float array": (lambda llm: llm.generate(np.array([1.0, 2.0])), "integer dtype"),
    "3-D array": (lambda llm: llm.generate(np.zeros((1, 1, 2), np.int64)), "1-D .* or 2-D"),
    "dict prompt": (lambda llm: llm.generate({"a": 1}), "prompt is a dict"),
    "None prompt": (lambda llm: llm.generate(None), "prompt is a NoneType"),
    "batch item float": (lambda llm: llm.generate([[5, 6], [7.5]]), "prompt 1: token id 0 is a float"),
    "stream batch": (lambda llm: llm.stream(["a", "b"]), "stream takes one prompt"),
    "stream bytes": (lambda llm: llm.stream(b"x"), "prompt is bytes"),
    "stop=5": (lambda llm: llm.generate("hi", stop=5), "stop must be a string or a list"),
    "stop=[5]": (lambda llm: llm.generate("hi", stop=[5]), "stop must be"),
    "stop_token_ids=5": (lambda llm: llm.generate("hi", stop_token_ids=5), "stop_token_ids must be a list"),
    "stop_token_ids=['a']": (lambda llm: llm.generate("hi", stop_token_ids=["a"]), "stop_token_ids must be"),
    "stop_token_ids=[30.7]": (lambda llm: llm.generate("hi", stop_token_ids=[30.7]), "stop_token_ids must be"),
    "temperature str": (lambda llm: llm.generate("hi", temperature="0.5"), "temperature must be a number"),
    "max_new_tokens float": (lambda llm: llm.generate("hi", max_new_tokens=30.7), "max_new_tokens must be an integer"),
    "top_k float": (lambda llm: llm.generate("hi", top_k=2.5), "top_k must be an integer"),
    "seed str": (lambda llm: llm.generate("hi", seed="1"), "seed must be None or an integer"),
    "nan top_p": (lambda llm: llm.generate("hi", top_p=float("nan")), "top_p must be"),
    "generate_many int": (lambda llm: llm.generate_many([1]), "request 0 is a int"),
    "generate_many str": (lambda llm: llm.generate_many("hi"), "requests is a str"),
    "generate_many bad params": (lambda llm: llm.generate_many([Request("a", SamplingParams(stop=5))]), "stop must"),
    "generate_many bad prompt": (lambda llm: llm.generate_many([{"prompt": b"x"}]), "request 0 is bytes"),
    "chat str": (lambda llm: llm.chat("hello"), "chat messages must be"),
    "chat surrogate": (lambda llm: llm.chat([{"role": "user", "content": "\udfff"}]), "lone surrogate"),
    "encode bytes": (lambda llm: llm.encode(b"x"), "prompt is bytes"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_are_one_line_errors_before_any_work(name):
    call, match = BAD_CALLS[name]
    llm = make_llm(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DecodertError, match=match) as info:
        call(llm)
    assert "\n" not in str(info.value)
    assert llm.backend.calls == []


def test_accepted_forms_give_the_same_tokens():
    llm = make_llm()
    ids = llm.encode("hello world").tolist()
    plain = llm.generate(ids, max_new_tokens=4).token_ids
    for form in (tuple(ids), np.array(ids, np.int32), np.array(ids, np.uint64), [np.int64(i) for i in ids]):
        assert llm.generate(form, max_new_tokens=4).token_ids == plain
    batch = llm.generate([ids, "hello world"], max_new_tokens=4)
    assert [r.token_ids for r in batch] == [plain, plain]
    rows = llm.generate(np.array([ids, ids]), max_new_tokens=4)
    assert [r.token_ids for r in rows] == [plain, plain]
    stops = SamplingParams(stop_token_ids=[np.int64(3), 4], stop="x")
    assert stops.stop_token_ids == (3, 4) and stops.stop == ("x",)
