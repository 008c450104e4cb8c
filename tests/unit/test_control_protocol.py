"""oomguard.control.protocol: varlink framing (JSON + NUL), call decoding and parameter checks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from oomguard.control.protocol import (
    INTERFACE,
    MAX_MESSAGE,
    Call,
    FrameBuffer,
    ProtocolError,
    decode_call,
    encode,
    error,
    param,
    reply,
)

# -- encode ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "wire"),
    [
        ({}, b"{}\0"),
        ({"method": "io.oomguard.List"}, b'{"method":"io.oomguard.List"}\0'),
        ({"parameters": {"id": "x", "n": 1}}, b'{"parameters":{"id":"x","n":1}}\0'),
        ({"a": [1, None, True]}, b'{"a":[1,null,true]}\0'),
        ({"s": "caf\u00e9"}, b'{"s":"caf\\u00e9"}\0'),  # ASCII on the wire
        ({"s": "a\0b"}, b'{"s":"a\\u0000b"}\0'),  # a NUL inside a string cannot end the frame
    ],
    ids=["empty", "call", "params", "literals", "non-ascii", "embedded-nul"],
)
def test_encode(message: dict[str, Any], wire: bytes) -> None:
    assert encode(message) == wire
    assert wire.count(b"\0") == 1
    assert json.loads(wire[:-1]) == message


def test_reply_and_error_shapes() -> None:
    assert reply({"id": "x"}) == {"parameters": {"id": "x"}}
    assert error("io.oomguard.NotFound", "gone") == {
        "error": "io.oomguard.NotFound", "parameters": {"message": "gone"}}


# -- decode_call -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"method":"io.oomguard.List"}', Call("List", {})),
        (b'{"method":"io.oomguard.List","parameters":{}}', Call("List", {})),
        (b'{"method":"io.oomguard.Show","parameters":{"id":"abc"}}', Call("Show", {"id": "abc"})),
        (b'{"method":"org.varlink.service.GetInfo"}', Call("org.varlink.service.GetInfo", {})),
        (b'{"method":"List"}', Call("List", {})),  # a short name stays as it is
        (b'{"method":"io.oomguardx.List"}', Call("io.oomguardx.List", {})),  # not our prefix
        (b'{"method":"com.example.io.oomguard.List"}', Call("com.example.io.oomguard.List", {})),
        (b'{"method":"io.oomguard.Restore","parameters":{"id":"a","force":true},"oneway":false}',
         Call("Restore", {"id": "a", "force": True})),  # unknown keys ignored
        (' {"method": "io.oomguard.Show", "parameters": {"id": "\u00e9t\u00e9"}} '.encode(),
         Call("Show", {"id": "\u00e9t\u00e9"})),  # UTF-8, whitespace
    ],
    ids=["short-of-full", "empty-params", "params", "foreign", "bare", "lookalike-prefix",
         "embedded-prefix", "extra-keys", "utf8"],
)
def test_decode_call(raw: bytes, expected: Call) -> None:
    assert decode_call(raw) == expected


def test_decode_call_parameters_default_is_a_fresh_dict() -> None:
    first = decode_call(b'{"method":"io.oomguard.List"}')
    first.parameters["x"] = 1
    assert decode_call(b'{"method":"io.oomguard.List"}').parameters == {}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "message is not JSON"),
        (b"not json", "message is not JSON"),
        (b'{"method":"io.oomguard.List"', "message is not JSON"),
        (b'{"method":"\xff\xfe"}', "message is not JSON"),  # invalid UTF-8
        (b"\xc3", "message is not JSON"),  # truncated UTF-8 sequence
        (b"[]", "message is not a JSON object"),
        (b'["io.oomguard.List"]', "message is not a JSON object"),
        (b'"io.oomguard.List"', "message is not a JSON object"),
        (b"42", "message is not a JSON object"),
        (b"null", "message is not a JSON object"),
        (b"{}", "no method"),
        (b'{"parameters":{}}', "no method"),
        (b'{"method":""}', "no method"),
        (b'{"method":null}', "no method"),
        (b'{"method":42}', "no method"),
        (b'{"method":["io.oomguard.List"]}', "no method"),
        (b'{"method":"io.oomguard.List","parameters":[]}', "parameters is not an object"),
        (b'{"method":"io.oomguard.List","parameters":"id"}', "parameters is not an object"),
        (b'{"method":"io.oomguard.List","parameters":3}', "parameters is not an object"),
        (b'{"method":"io.oomguard.List","parameters":null}', "parameters is not an object"),
    ],
    ids=["empty", "text", "truncated", "bad-utf8", "partial-utf8", "array", "array-of-name",
         "string", "number", "null", "no-method", "params-only", "empty-method", "null-method",
         "int-method", "list-method", "params-array", "params-string", "params-int", "params-null"],
)
def test_decode_call_rejects(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_call(raw)
    assert str(caught.value) == message


def test_encode_decode_round_trip() -> None:
    wire = encode({"method": f"{INTERFACE}.Checkpoint", "parameters": {"pid": 42, "reason": "r\0"}})
    assert decode_call(wire[:-1]) == Call("Checkpoint", {"pid": 42, "reason": "r\0"})


# -- FrameBuffer -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("chunks", "frames"),
    [
        ([b"a\0"], [[b"a"]]),
        ([b"a\0b\0c\0"], [[b"a", b"b", b"c"]]),  # several frames in one chunk
        ([b"a\0b"], [[b"a"]]),  # the partial rest waits
        ([b"ab", b"cd", b"ef\0"], [[], [], [b"abcdef"]]),  # one frame over several chunks
        ([b"a", b"\0b", b"\0"], [[], [b"a"], [b"b"]]),
        ([b"a\0bc", b"d\0e\0f"], [[b"a"], [b"bcd", b"e"]]),
        ([b"\0"], [[b""]]),  # an empty frame is a frame (decode_call rejects it)
        ([b"\0\0"], [[b"", b""]]),
        ([b""], [[]]),
        ([b"x", b"", b"\0"], [[], [], [b"x"]]),
    ],
    ids=["one", "three-in-one-chunk", "partial-rest", "split-over-three", "nul-at-chunk-start",
         "mixed", "empty-frame", "two-empty-frames", "empty-chunk", "empty-chunk-between"],
)
def test_framebuffer_feed(chunks: list[bytes], frames: list[list[bytes]]) -> None:
    buffer = FrameBuffer()
    assert [buffer.feed(c) for c in chunks] == frames


def test_framebuffer_byte_by_byte() -> None:
    wire = encode({"method": "io.oomguard.List"}) + encode({"method": "io.oomguard.Status"})
    buffer = FrameBuffer()
    got: list[bytes] = []
    for index in range(len(wire)):
        got += buffer.feed(wire[index:index + 1])
    assert [decode_call(f).method for f in got] == ["List", "Status"]
    assert buffer.data == b""


def test_framebuffer_default_limit() -> None:
    assert FrameBuffer().limit == MAX_MESSAGE == 64 * 1024


@pytest.mark.parametrize("limit", [1, 10, 100])
def test_framebuffer_partial_up_to_limit_is_kept(limit: int) -> None:
    buffer = FrameBuffer(limit=limit)
    assert buffer.feed(b"x" * limit) == []
    assert buffer.feed(b"\0") == [b"x" * limit]


@pytest.mark.parametrize(
    "chunks",
    [[b"x" * 11], [b"x" * 5, b"x" * 6], [b"ok\0" + b"x" * 11], [b"x" * 10, b"y"]],
    ids=["one-chunk", "two-chunks", "after-a-good-frame", "one-byte-over"],
)
def test_framebuffer_limit_exceeded(chunks: list[bytes]) -> None:
    buffer = FrameBuffer(limit=10)
    with pytest.raises(ProtocolError, match="message larger than 10 bytes"):
        for chunk in chunks:
            buffer.feed(chunk)


def test_framebuffer_default_limit_exceeded() -> None:
    buffer = FrameBuffer()
    assert buffer.feed(b"{" * MAX_MESSAGE) == []
    with pytest.raises(ProtocolError, match=f"larger than {MAX_MESSAGE} bytes"):
        buffer.feed(b"{")


def test_framebuffer_complete_frame_over_limit_is_rejected() -> None:
    buffer = FrameBuffer(limit=10)
    assert buffer.feed(b"x" * 9) == []
    with pytest.raises(ProtocolError, match="message larger than 10 bytes"):
        buffer.feed(b"y" * 50 + b"\0")


# -- param -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("params", "name", "kind", "required", "expected"),
    [
        ({"id": "abc"}, "id", str, True, "abc"),
        ({"id": ""}, "id", str, True, ""),  # present, if empty
        ({"pid": 42}, "pid", int, True, 42),
        ({"pid": 0}, "pid", int, True, 0),
        ({"pid": -1}, "pid", int, True, -1),
        ({"force": True}, "force", bool, False, True),
        ({"force": False}, "force", bool, False, False),
        ({}, "cgroup", str, False, None),
        ({"cgroup": None}, "cgroup", str, False, None),  # JSON null = absent
        ({"other": "x"}, "force", bool, False, None),
        ({"ratio": 0.5}, "ratio", float, True, 0.5),
    ],
    ids=["str", "empty-str", "int", "zero", "negative", "true", "false", "optional-absent",
         "optional-null", "optional-other-key", "float"],
)
def test_param_accepts(params: dict[str, Any], name: str, kind: type, required: bool,
                       expected: Any) -> None:
    value = param(params, name, kind, required=required)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("params", "name", "kind", "required", "message"),
    [
        ({}, "id", str, True, "missing parameter 'id'"),
        ({"id": None}, "id", str, True, "missing parameter 'id'"),
        ({"ID": "x"}, "id", str, True, "missing parameter 'id'"),
        ({"id": 5}, "id", str, True, "parameter 'id' must be str"),
        ({"id": ["x"]}, "id", str, True, "parameter 'id' must be str"),
        ({"pid": True}, "pid", int, True, "parameter 'pid' must be int"),  # bool is not int
        ({"pid": False}, "pid", int, True, "parameter 'pid' must be int"),
        ({"pid": "42"}, "pid", int, True, "parameter 'pid' must be int"),
        ({"pid": 42.0}, "pid", int, True, "parameter 'pid' must be int"),
        ({"pid": {"n": 1}}, "pid", int, True, "parameter 'pid' must be int"),
        ({"force": 1}, "force", bool, False, "parameter 'force' must be bool"),
        ({"force": "true"}, "force", bool, False, "parameter 'force' must be bool"),
        ({"cgroup": 7}, "cgroup", str, False, "parameter 'cgroup' must be str"),
    ],
    ids=["missing", "null", "wrong-case", "int-for-str", "list-for-str", "true-for-int",
         "false-for-int", "str-for-int", "float-for-int", "object-for-int", "int-for-bool",
         "str-for-bool", "optional-wrong-type"],
)
def test_param_rejects(params: dict[str, Any], name: str, kind: type, required: bool,
                       message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        param(params, name, kind, required=required)
    assert str(caught.value) == message
