"""mtc.operations: the one table of host operations. Each host side serves exactly
its side's operations, a typed request crosses as the bytes the host side
decodes, and a reply comes back typed."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from mtc import errors, operations
from mtc.contract import (
    AgentConfig,
    Piece,
    ReadTask,
    decode_reply,
    decode_request,
    error_fields,
    error_from,
    typed_error,
)
from mtc.manifest import ShardEntry
from mtc.operations import (
    HELLO,
    LOAD,
    OPEN,
    POLL,
    READ,
    RETAIN,
    STAGE,
    STEPS,
    SURVEY,
    Hello,
    Loaded,
    NoArgs,
    Opened,
    OpenRequest,
    ReadRequest,
    RetainRequest,
    Side,
    StageRequest,
    StepRequest,
    Surveyed,
    SurveyRequest,
)


def _config(root: Path) -> AgentConfig:
    return AgentConfig(local_dir=str(root), host_of_device={}, slice_of_host={0: 0},
                       subdirs=False, max_staged_bytes=None, writer_threads=1)


def test_every_side_names_a_class_of_the_host_side() -> None:
    for side in Side:
        module, name = side.value.rsplit(".", 1)
        assert isinstance(getattr(importlib.import_module(module), name), type), side


def test_the_host_sides_serve_exactly_their_sides_operations(tmp_path: Path) -> None:
    from mtc.sidecar.colocated import ColocatedAgent
    from mtc.sidecar.host.service import HostService
    from mtc.sidecar.ops import HostOps

    ops = HostOps(_config(tmp_path))
    service = HostService(_config(tmp_path), 0, tmp_path)
    try:
        assert set(ops._ops) == set(operations.names([Side.ROOT]))
        assert set(service._ops) == set(operations.names([Side.SAVES, Side.LOADS,
                                                          Side.SIDECAR]))
        # A worker answers a save's and a restore's by methods of the same names.
        assert all(callable(getattr(ColocatedAgent, n, None))
                   for n in operations.names([Side.SAVES, Side.LOADS]))
        # Another side's operation sent to the root's handler is refused, typed.
        with pytest.raises(errors.ProtocolError, match="unknown host operation"):
            decode_reply(ops.handle(STAGE.encode([0], StageRequest("{}", "save-0", 0, [],
                                                                   0, 1))))
    finally:
        service.close()
        ops.close()


_TASK = ReadTask(0, ((0, 2),), "float32", (5,), (Piece(0, ShardEntry(
    ((0, 2),), "0.bin", 8, 0)),))
_TASK_JSON = ('{"leaf": 0, "index": [[0, 2]], "dtype": "float32", "devices": [5], '
              '"pieces": [{"host": 0, "entry": ')


@pytest.mark.parametrize(("op", "request_", "args"), [
    (STEPS, NoArgs(), "{}"),
    (SURVEY, SurveyRequest(True), '{"manifest": true}'),
    (SURVEY, SurveyRequest(False, 3), '{"manifest": false, "step": 3}'),
    (OPEN, OpenRequest(lock=True, clean=False),
     '{"lock": true, "clean": false, "identify": false}'),
    (RETAIN, RetainRequest([1, 2], 3, None, True),
     '{"complete": [1, 2], "max_to_keep": 3, "keep_period": null, "before_write": true}'),
    (STAGE, StageRequest("{}", "save-1", 64, [[0, [[0, 2]], "<f4", [2], 0]], 1, 2),
     '{"header": "{}", "slot": "save-1", "size": 64, "shards": [[0, [[0, 2]], "<f4", [2], 0]],'
     ' "slice": 1, "num_hosts": 2}'),
])
def test_a_typed_request_crosses_as_the_bytes_the_host_side_reads(
        op: operations.Operation[Any, Any], request_: operations.Request, args: str) -> None:
    raw = op.encode([1], request_)
    assert raw == f'{{"op": "{op.name}", "hosts": [1], "args": {args}}}'.encode()
    name, hosts, _ = decode_request(raw)
    assert (name, hosts) == (op.name, [1])


def test_read_tasks_cross_as_a_list_or_by_host() -> None:
    as_list = READ.encode([0], ReadRequest(4, [_TASK])).decode()
    assert as_list.startswith('{"op": "read", "hosts": [0], "args": {"step": 4, "tasks": ['
                              + _TASK_JSON)
    by_host = LOAD.encode([0], ReadRequest(4, {0: [_TASK]})).decode()
    assert '"tasks": {"0": [' + _TASK_JSON in by_host


def test_a_request_of_another_type_is_refused() -> None:
    with pytest.raises(TypeError, match="takes a StepRequest"):
        operations.MANIFEST.encode([0], NoArgs())


def test_replies_come_back_typed() -> None:
    assert STEPS.reply({"0": [1, 2], "3": []}) == {0: [1, 2], 3: []}
    assert STEPS.reply(None) == {}  # a worker asked about no host of its own
    assert RETAIN.reply({"1": [10, 4]}) == {1: (10, 4)}
    assert OPEN.reply({"2": {"removed": ["5.mtc-tmp-x"], "foreign": [7], "identity": "id",
                             "manifest_bytes": 9}}) == {2: Opened(("5.mtc-tmp-x",), (7,), "id", 9)}
    got = SURVEY.reply({"0": {"steps": [1, 2], "facts": {"2": [4, "run"]}, "step": 2,
                              "manifest": "{}", "space": [5, 6], "manifest_bytes": 2}})
    assert got == {0: Surveyed([1, 2], {2: (4, "run")}, (2, "{}"), (5, 6), 2)}
    none = SURVEY.reply({"0": {"steps": [], "facts": {}, "step": None, "manifest": None,
                               "space": None, "manifest_bytes": 0}})
    assert none == {0: Surveyed([], {}, None, None, 0)}
    assert POLL.reply(["save-0"]) == ["save-0"]
    assert LOAD.reply({"file": "reply-x", "size": 8, "offsets": [0]}) == Loaded("reply-x", 8, [0])
    assert HELLO.reply({"host": 3, "rank": 0, "area": "/a", "colocated": True,
                        "programs": 2}) == Hello(3, 0, "/a", True, 2)


@pytest.mark.parametrize("rank", ["0", None, 1.0])
def test_a_hello_whose_rank_is_not_an_integer_is_refused(rank: Any) -> None:
    with pytest.raises(errors.ProtocolError, match="names no rank"):
        HELLO.reply({"host": 0, "rank": rank, "area": "/a"})


def test_a_typed_error_crosses_as_itself() -> None:
    e = errors.CorruptShardError("bad bytes", step=3, host=1, path="3/0.bin")
    back = error_from(error_fields(e))
    assert type(back) is errors.CorruptShardError
    assert (back.message, back.step, back.host, back.path) == ("bad bytes", 3, 1, "3/0.bin")
    # A class mtc does not have comes as the caller's default, naming the host asked.
    other = error_from({**error_fields(e), "type": "OSError", "host": None},
                       default=errors.ColocatedCallError, host=2)
    assert type(other) is errors.ColocatedCallError and other.host == 2


def test_a_step_request_carries_its_step() -> None:
    assert StepRequest(7).args() == {"step": 7}


@pytest.mark.parametrize(("raised", "kind", "message"), [
    (errors.ManifestError("bad", step=2), errors.ManifestError, "bad"),
    (FileNotFoundError(2, "No such file", "/r/2/x"), errors.StorageError,
     "sidecar: No such file"),
    (KeyError("slot"), errors.ProtocolError, "malformed stage request: KeyError('slot')"),
])
def test_a_host_side_answers_what_it_raised_as_a_typed_error(
        raised: Exception, kind: type[errors.MtcError], message: str) -> None:
    got = typed_error(raised, storage="sidecar", request="stage", host=3)
    assert type(got) is kind and got.message == message
    if not isinstance(raised, errors.MtcError):  # mtc's own error keeps what it names
        assert got.host == 3
    if isinstance(raised, OSError):
        assert got.path == "/r/2/x"
