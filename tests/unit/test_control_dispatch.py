"""oomguard.control.server: dispatch() over a real Service and Store, and a real socket round trip.

The restorer and checkpointer are doubles that fail the test if touched, except where a test
records what reached them; no root, cgroups or CRIU are needed.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from oomguard import __version__
from oomguard.cgroup.mounts import CgroupLayout
from oomguard.control.client import ControlClient, ControlError, DaemonUnavailable
from oomguard.control.limits import ConnectionLimiter
from oomguard.control.protocol import (
    INTERFACE,
    INTERFACE_DESCRIPTION,
    METHODS,
    FrameBuffer,
    encode,
)
from oomguard.control.server import ControlServer, dispatch
from oomguard.control.service import Service
from oomguard.observe.rendering import paged_out_detail
from oomguard.sense.procfs import ProcReader
from oomguard.store.checkpoints import CheckpointMeta, Store
from oomguard.store.pagedout import PagedOutRecord, PagedOutTree
from tests.unit._support import FakeProc, fake_proc_tree

NO_CGROUPS = CgroupLayout(memory_v1=None, unified=None, unified_controllers=())
NOT_FOUND = "io.oomguard.NotFound"
INVALID = "io.oomguard.InvalidRequest"
DENIED = "io.oomguard.PermissionDenied"
FAILED = "io.oomguard.Failed"
NO_METHOD = "org.varlink.service.MethodNotFound"

# id -> (uid, created, pages-1.img size)
CHECKPOINTS = {
    "root-job": (0, 1_700_000_050.0, 512),
    "alice-1": (1001, 1_700_000_100.0, 4096),
    "bob-1": (1002, 1_700_000_150.0, 2048),
    "alice-2": (1001, 1_700_000_200.0, 1024),
}
ALICE, BOB = 1001, 1002
ALICE_PID, BOB_PID, BOB_CHILD, GONE_PID = 600, 500, 501, 4242


class Forbidden:
    """A collaborator the code under test must not touch."""

    def __init__(self, what: str) -> None:
        self._what = what

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"{self._what}.{name} must not be used here")


def make_meta(checkpoint_id: str, uid: int, created: float) -> CheckpointMeta:
    return CheckpointMeta(
        id=checkpoint_id, pid=7000 + uid, pids=[7000 + uid], command="python3 job.py",
        comm="python3", uid=uid, user=f"user{uid}", cgroup="/jobs/a", cgroup_version=2,
        rss_bytes=100 << 20, reason="test", criu_version="4.0", created=created)


def add_checkpoint(store: Store, checkpoint_id: str, uid: int, created: float, size: int) -> None:
    meta = make_meta(checkpoint_id, uid, created)
    images, lock_fd = store.begin(meta)
    os.close(lock_fd)
    (images / "pages-1.img").write_bytes(b"\x5a" * size)
    store.commit(meta)


@pytest.fixture(scope="module")
def store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints, written once through Store.begin/commit (fsyncs are slow) and copied."""
    st = Store(tmp_path_factory.mktemp("template") / "store")
    for checkpoint_id, (uid, created, size) in CHECKPOINTS.items():
        add_checkpoint(st, checkpoint_id, uid, created, size)
    return st.root


@pytest.fixture
def store(tmp_path: Path, store_template: Path) -> Store:
    root = tmp_path / "store"
    shutil.copytree(store_template, root)
    return Store(root)


@pytest.fixture
def proc(tmp_path: Path) -> ProcReader:
    root = fake_proc_tree(tmp_path / "proc", [
        FakeProc(BOB_PID, 1, comm="bobjob", uid=BOB, children={BOB_PID: [BOB_CHILD]}),
        FakeProc(BOB_CHILD, BOB_PID, comm="bobkid", uid=BOB),
        FakeProc(ALICE_PID, 1, comm="alicejob", uid=ALICE, cgroup="0::/user.slice/alice\n"),
    ])
    return ProcReader(root)


STATUS = {"daemon": True, "guards": [{"name": "/jobs/a"}],
          "recent_events": [{"event": "checkpoint.done", "uid": 1002}]}


@pytest.fixture
def service(store: Store, proc: ProcReader) -> Service:
    return Service(store, restorer=Forbidden("restorer"),  # type: ignore[arg-type]
                   checkpointer=Forbidden("checkpointer"),  # type: ignore[arg-type]
                   layout=NO_CGROUPS, proc=proc, status=lambda: STATUS)


def call(service: Service, uid: int, method: str, **parameters: Any) -> dict[str, Any]:
    raw = json.dumps({"method": method, "parameters": parameters}).encode()
    _name, message = dispatch(service, raw, uid)
    return message


def err(message: dict[str, Any]) -> tuple[str, str]:
    assert set(message) == {"error", "parameters"}, message
    return message["error"], message["parameters"]["message"]


def ids_of(message: dict[str, Any]) -> list[str]:
    return [c["id"] for c in message["parameters"]["checkpoints"]]


# -- List / Show -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("uid", "expected"),
    [
        (ALICE, ["alice-1", "alice-2"]),
        (BOB, ["bob-1"]),
        (0, ["root-job", "alice-1", "bob-1", "alice-2"]),  # everything, oldest first
        (1003, []),
    ],
    ids=["alice", "bob", "root", "stranger"],
)
def test_list_shows_only_own_checkpoints(service: Service, uid: int, expected: list[str]) -> None:
    for method in ("io.oomguard.List", "List"):
        assert ids_of(call(service, uid, method)) == expected


def test_list_entries_are_full_metadata(service: Service, store: Store) -> None:
    listed = call(service, ALICE, "io.oomguard.List")["parameters"]["checkpoints"]
    assert listed == [asdict(store.get("alice-1")), asdict(store.get("alice-2"))]
    assert listed[0]["image_bytes"] == 4096
    assert listed[0]["state"] == "checkpointed"


@pytest.mark.parametrize(("uid", "checkpoint_id"),
                         [(ALICE, "alice-1"), (BOB, "bob-1"), (0, "alice-2"), (0, "bob-1")])
def test_show_own_or_as_root(service: Service, store: Store, uid: int, checkpoint_id: str) -> None:
    message = call(service, uid, "io.oomguard.Show", id=checkpoint_id)
    assert message == {"parameters": {"checkpoint": asdict(store.get(checkpoint_id))}}


@pytest.mark.parametrize(
    ("uid", "checkpoint_id", "expected"),
    [
        (ALICE, "bob-1", (NOT_FOUND, "no checkpoint 'bob-1' of yours")),
        (BOB, "alice-1", (NOT_FOUND, "no checkpoint 'alice-1' of yours")),
        (ALICE, "root-job", (NOT_FOUND, "no checkpoint 'root-job' of yours")),
        (ALICE, "nosuch", (NOT_FOUND, "no checkpoint 'nosuch' of yours")),  # same as another's
        (0, "nosuch", (NOT_FOUND, "no checkpoint 'nosuch'")),
        (ALICE, "../x", (INVALID, "invalid checkpoint id '../x'")),
        (0, "../x", (INVALID, "invalid checkpoint id '../x'")),
        (ALICE, ".partial-alice-1", (INVALID, "invalid checkpoint id '.partial-alice-1'")),
        (ALICE, "", (INVALID, "invalid checkpoint id ''")),
        (ALICE, "a/b", (INVALID, "invalid checkpoint id 'a/b'")),
    ],
    ids=["alice-sees-bob", "bob-sees-alice", "alice-sees-root", "alice-unknown", "root-unknown",
         "dotdot", "root-dotdot", "partial", "empty", "slash"],
)
def test_show_refused(service: Service, uid: int, checkpoint_id: str,
                      expected: tuple[str, str]) -> None:
    assert err(call(service, uid, "io.oomguard.Show", id=checkpoint_id)) == expected


@pytest.mark.parametrize(
    ("parameters", "message"),
    [({}, "missing parameter 'id'"), ({"id": 5}, "parameter 'id' must be str"),
     ({"id": None}, "missing parameter 'id'")],
)
def test_show_bad_parameters(service: Service, parameters: dict[str, Any], message: str) -> None:
    assert err(call(service, ALICE, "io.oomguard.Show", **parameters)) == (INVALID, message)


# -- Forget ----------------------------------------------------------------------------------------

def test_forget_own(service: Service, store: Store) -> None:
    assert store.path_of("alice-1").is_dir()
    assert call(service, ALICE, "io.oomguard.Forget", id="alice-1") == {"parameters": {"id": "alice-1"}}
    assert not store.path_of("alice-1").exists()
    assert ids_of(call(service, ALICE, "io.oomguard.List")) == ["alice-2"]
    assert err(call(service, ALICE, "io.oomguard.Forget", id="alice-1")) == (
        NOT_FOUND, "no checkpoint 'alice-1' of yours")


def test_forget_of_another_is_refused_and_leaves_it(service: Service, store: Store) -> None:
    before = sorted(p.name for p in store.path_of("bob-1").rglob("*"))
    assert err(call(service, ALICE, "io.oomguard.Forget", id="bob-1")) == (
        NOT_FOUND, "no checkpoint 'bob-1' of yours")
    assert sorted(p.name for p in store.path_of("bob-1").rglob("*")) == before
    assert ids_of(call(service, BOB, "io.oomguard.List")) == ["bob-1"]


def test_root_forgets_anyones(service: Service, store: Store) -> None:
    assert call(service, 0, "io.oomguard.Forget", id="bob-1") == {"parameters": {"id": "bob-1"}}
    assert not store.path_of("bob-1").exists()


def test_forget_bad_id_touches_nothing(service: Service, store: Store, tmp_path: Path) -> None:
    victim = tmp_path / "x"
    victim.mkdir()
    (victim / "meta.json").write_text("{}")
    assert err(call(service, 0, "io.oomguard.Forget", id="../x"))[0] == INVALID
    assert victim.is_dir()


# -- Restore (authorization only: the restorer is reached only where allowed) -----------------------

def test_restore_of_another_is_not_found_and_never_reaches_restorer(service: Service) -> None:
    assert err(call(service, ALICE, "io.oomguard.Restore", id="bob-1")) == (
        NOT_FOUND, "no checkpoint 'bob-1' of yours")


@pytest.mark.parametrize(
    ("parameters", "message"),
    [({"id": "alice-1", "force": "yes"}, "parameter 'force' must be bool"),
     ({"id": "alice-1", "cgroup": 3}, "parameter 'cgroup' must be str"),
     ({"force": True}, "missing parameter 'id'")],
)
def test_restore_bad_parameters(service: Service, parameters: dict[str, Any], message: str) -> None:
    assert err(call(service, ALICE, "io.oomguard.Restore", **parameters)) == (INVALID, message)


def test_restore_own_reaches_restorer(service: Service) -> None:
    seen: list[tuple[Any, ...]] = []

    def restore(checkpoint_id: str, *, target: Any, original: Any, force: bool,
                lazy: bool) -> Any:
        seen.append((checkpoint_id, target, original, force, lazy))
        return SimpleNamespace(pid=4321, seconds=0.12345, verify_s=0.0456, total_s=0.2,
                               lazy=True, lazy_fallback=None, warmed_bytes=6 << 20,
                               gpu_pids=(), gpu_error=None,
                               meta=SimpleNamespace(restored_cgroup="/jobs/a"))

    service.restorer = SimpleNamespace(restore=restore)  # type: ignore[assignment]
    assert call(service, ALICE, "io.oomguard.Restore", id="alice-2", force=True,
                lazy=True) == {
        "parameters": {"id": "alice-2", "pid": 4321, "was_pid": 7000 + ALICE, "seconds": 0.123,
                       "verify_s": 0.046, "total_s": 0.2, "lazy": True, "lazy_fallback": None,
                       "warmed_bytes": 6 << 20, "cgroup": "/jobs/a"}}
    assert seen == [("alice-2", None, None, True, True)]


def test_restore_into_named_cgroup_without_memory_controller_fails(service: Service) -> None:
    name, message = err(call(service, ALICE, "io.oomguard.Restore", id="alice-1",
                             cgroup="/sys/fs/cgroup/jobs/b"))
    assert name == FAILED
    assert message.startswith("--cgroup: ")


# -- Checkpoint ------------------------------------------------------------------------------------

def test_checkpoint_of_missing_pid_fails(service: Service) -> None:
    assert err(call(service, ALICE, "io.oomguard.Checkpoint", pid=GONE_PID)) == (
        FAILED, f"no process {GONE_PID}")
    assert err(call(service, 0, "io.oomguard.Checkpoint", pid=GONE_PID))[0] == FAILED


def test_checkpoint_of_another_users_process_is_denied(service: Service) -> None:
    assert err(call(service, ALICE, "io.oomguard.Checkpoint", pid=BOB_PID)) == (
        DENIED, f"process {BOB_PID} is not yours")
    assert err(call(service, BOB, "io.oomguard.Checkpoint", pid=ALICE_PID)) == (
        DENIED, f"process {ALICE_PID} is not yours")


@pytest.mark.parametrize(
    ("parameters", "message"),
    [({}, "missing parameter 'pid'"), ({"pid": "600"}, "parameter 'pid' must be int"),
     ({"pid": True}, "parameter 'pid' must be int"), ({"pid": 600.0}, "parameter 'pid' must be int"),
     ({"pid": 600, "reason": 1}, "parameter 'reason' must be str")],
)
def test_checkpoint_bad_parameters(service: Service, parameters: dict[str, Any], message: str) -> None:
    assert err(call(service, ALICE, "io.oomguard.Checkpoint", **parameters)) == (INVALID, message)


@pytest.mark.parametrize(
    ("uid", "pid", "reason", "want_pids", "want_reason"),
    [
        (BOB, BOB_PID, None, (BOB_PID, BOB_CHILD), "on demand (control socket)"),
        (0, BOB_PID, "make room", (BOB_PID, BOB_CHILD), "make room"),
        (ALICE, ALICE_PID, "", (ALICE_PID,), "on demand (control socket)"),
    ],
    ids=["owner", "root", "owner-empty-reason"],
)
def test_checkpoint_allowed_reaches_checkpointer(service: Service, uid: int, pid: int,
                                                 reason: str | None, want_pids: tuple[int, ...],
                                                 want_reason: str) -> None:
    seen: list[tuple[Any, ...]] = []
    meta = make_meta("new-one", uid, 1_700_000_300.0)

    def checkpoint(tree: Any, cgroup: Any, why: str, requester: int | None = None,
                   headroom: int | None = None, rights_of: int | None = None) -> Any:
        seen.append((tree.pids, cgroup, why, requester, headroom))
        return SimpleNamespace(meta=meta, timings=SimpleNamespace(
            total_s=2.71828, freeze_s=0.00312, dump_s=2.5, commit_s=0.21828))

    service.checkpointer = SimpleNamespace(checkpoint=checkpoint)  # type: ignore[assignment]
    params: dict[str, Any] = {"pid": pid} if reason is None else {"pid": pid, "reason": reason}
    raw = json.dumps({"method": "io.oomguard.Checkpoint", "parameters": params}).encode()
    _name, message = dispatch(service, raw, uid, 31337)
    assert message == {"parameters": {"checkpoint": {
        **asdict(meta), "seconds": 2.718, "freeze_s": 0.0031, "dump_s": 2.5, "commit_s": 0.2183,
        "asked_pid": pid}}}
    # no memory controller: no cgroup (so no headroom question); the caller's pid
    # (SO_PEERCRED) goes with the request
    assert seen == [(want_pids, None, want_reason, 31337, None)]



def test_root_without_a_daemon_calls_the_same_verbs(service: Service,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI on the store itself (LocalBackend) goes through the socket's table of verbs:
    the same parameter checks, the same checkpoint, its own default reason and no requester."""
    from oomguard.control.backend import LocalBackend
    from oomguard.model.errors import OomguardError

    seen: list[tuple[Any, ...]] = []
    meta = make_meta("direct-one", 0, 1_700_000_400.0)

    def checkpoint(tree: Any, cgroup: Any, why: str, requester: int | None = None,
                   headroom: int | None = None, rights_of: int | None = None) -> Any:
        seen.append((tree.pids, why, requester))
        return SimpleNamespace(meta=meta, timings=SimpleNamespace(
            total_s=1.0, freeze_s=0.001, dump_s=0.9, commit_s=0.099))

    service.checkpointer = SimpleNamespace(checkpoint=checkpoint)  # type: ignore[assignment]
    backend = LocalBackend.__new__(LocalBackend)
    needs: list[bool] = []
    monkeypatch.setattr(backend, "_get_service",
                        lambda needs_criu: needs.append(needs_criu) or service, raising=False)
    monkeypatch.setattr("os.geteuid", lambda: 0)
    done = backend.call("Checkpoint", pid=BOB_PID, reason=None)
    assert done["checkpoint"]["id"] == "direct-one"
    assert seen == [((BOB_PID, BOB_CHILD), "on demand", None)] and needs == [True]
    assert [m["id"] for m in backend.call("List")["checkpoints"]] == \
        [m["id"] for m in call(service, 0, "io.oomguard.List")["parameters"]["checkpoints"]]
    assert needs == [True, False]  # CRIU is located only for the verbs that run it
    with pytest.raises(OomguardError, match="parameter 'pid' must be int"):
        backend.call("Checkpoint", pid="600")
    with pytest.raises(OomguardError, match="unknown verb Nope"):
        backend.call("Nope")

# -- Status ------------------------------------------------------------------------------------------

def test_status_hides_recent_events_from_users(service: Service) -> None:
    alice = call(service, ALICE, "io.oomguard.Status")["parameters"]["status"]
    assert "recent_events" not in alice
    assert alice["daemon"] is True
    assert alice["guards"] == STATUS["guards"]
    assert alice["checkpoints"] == {"count": 2, "checkpointed": 2, "bytes": 4096 + 1024}
    root = call(service, 0, "io.oomguard.Status")["parameters"]["status"]
    assert root["recent_events"] == STATUS["recent_events"]  # the user's call did not eat it
    assert root["checkpoints"] == {"count": 4, "checkpointed": 4, "bytes": 512 + 4096 + 2048 + 1024}
    assert "recent_events" in STATUS


def test_status_counts_restored_separately(service: Service, store: Store) -> None:
    meta = store.get("alice-1")
    meta.state = "restored"
    store.update(meta)
    alice = call(service, ALICE, "io.oomguard.Status")["parameters"]["status"]
    assert alice["checkpoints"] == {"count": 2, "checkpointed": 1, "bytes": 4096 + 1024}


def test_status_without_daemon_callable(store: Store, proc: ProcReader) -> None:
    bare = Service(store, Forbidden("restorer"), Forbidden("checkpointer"),  # type: ignore[arg-type]
                   NO_CGROUPS, proc=proc)
    status = call(bare, 0, "io.oomguard.Status")["parameters"]["status"]
    assert status["daemon"] is False
    assert "recent_events" not in status


# -- varlink service methods, unknown methods, garbage ------------------------------------------------

def test_get_info(service: Service) -> None:
    assert call(service, ALICE, "org.varlink.service.GetInfo") == {"parameters": {
        "vendor": "oomguard", "product": "oomguard", "version": __version__, "url": "",
        "interfaces": [INTERFACE]}}


def test_get_interface_description(service: Service) -> None:
    message = call(service, ALICE, "org.varlink.service.GetInterfaceDescription",
                   interface=INTERFACE)
    assert message == {"parameters": {"description": INTERFACE_DESCRIPTION}}
    description = message["parameters"]["description"]
    assert description.startswith(f"interface {INTERFACE}\n")
    for method in METHODS:
        assert f"\nmethod {method}(" in description


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("io.oomguard.Frobnicate", ("Frobnicate", "no method 'Frobnicate'")),
        ("io.oomguard.list", ("list", "no method 'list'")),  # names are case-sensitive
        ("org.varlink.service.Frobnicate", ("org.varlink.service.Frobnicate",
                                            "no method 'org.varlink.service.Frobnicate'")),
        ("com.example.List", ("com.example.List", "no method 'com.example.List'")),
    ],
    ids=["ours", "lowercase", "varlink-service", "foreign"],
)
def test_unknown_method(service: Service, method: str, expected: tuple[str, str]) -> None:
    raw = json.dumps({"method": method}).encode()
    name, message = dispatch(service, raw, ALICE)
    assert name == expected[0]
    assert err(message) == (NO_METHOD, expected[1])


@pytest.mark.parametrize(
    ("raw", "message"),
    [(b"garbage", "message is not JSON"), (b"\xff\xfe", "message is not JSON"),
     (b"[1]", "message is not a JSON object"), (b"{}", "no method"),
     (b'{"method":"io.oomguard.List","parameters":[]}', "parameters is not an object")],
)
def test_garbage_is_invalid_request(service: Service, raw: bytes, message: str) -> None:
    name, reply = dispatch(service, raw, ALICE)
    assert name == "?"
    assert err(reply) == (INVALID, message)


# -- a real socket -----------------------------------------------------------------------------------

def start_quick(srv: ControlServer) -> ControlServer:
    """srv.start(), with serve_forever polling for shutdown every 10 ms instead of 500 ms (so that
    each stop() is quick); everything else as in the daemon."""
    srv.serve_forever = functools.partial(ControlServer.serve_forever, srv,  # type: ignore[method-assign]
                                          poll_interval=0.01)
    srv.start()
    return srv


@pytest.fixture
def socket_path() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="og-", dir="/tmp"))
    path = directory / "ctl.sock"
    assert len(str(path)) < 100
    try:
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def notes() -> list[tuple[str, dict[str, Any]]]:
    return []


@pytest.fixture
def server(socket_path: Path, service: Service,
           notes: list[tuple[str, dict[str, Any]]]) -> Iterator[ControlServer]:
    lock = threading.Lock()

    def note(event: str, **fields: Any) -> None:
        with lock:
            notes.append((event, fields))

    def debug(event: str, **fields: Any) -> None:
        note(event, **fields, level="debug")

    srv = start_quick(ControlServer(socket_path, service, note=note, debug=debug))
    try:
        yield srv
    finally:
        srv.stop()


class _Reader:
    """Reads reply frames from a raw socket (several may arrive in one recv)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.frames = FrameBuffer()
        self.ready: list[bytes] = []

    def next(self) -> dict[str, Any] | None:
        while not self.ready:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.ready += self.frames.feed(chunk)
        result: dict[str, Any] = json.loads(self.ready.pop(0))
        return result


def _raw_connection(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def test_socket_round_trip(server: ControlServer, socket_path: Path, service: Service,
                           store: Store, notes: list[tuple[str, dict[str, Any]]]) -> None:
    me = os.getuid()
    assert socket_path.is_socket()
    assert socket_path.stat().st_mode & 0o777 == 0o666
    visible = [m["id"] for m in service.list(me)]
    with ControlClient(socket_path) as client:
        listed = client.call("List")
        assert [c["id"] for c in listed["checkpoints"]] == visible
        if visible:
            shown = client.call("Show", id=visible[0])
            assert shown == {"checkpoint": asdict(store.get(visible[0]))}
        with pytest.raises(ControlError) as caught:
            client.call("Show", id="../x")
        assert caught.value.name == INVALID
        assert str(caught.value) == "invalid checkpoint id '../x'"
        with pytest.raises(ControlError) as caught:
            client.call("Show", id="nosuch")
        assert caught.value.name == NOT_FOUND
        with pytest.raises(ControlError) as caught:
            client.call("Frobnicate")
        assert caught.value.name == NO_METHOD
        assert client.call("List") == listed  # the connection survives errors
    calls = [f for event, f in notes if event == "control.call"]
    expected = ["List", *(["Show"] if visible else []), "Show", "Show", "Frobnicate", "List"]
    assert [c["method"] for c in calls] == expected
    # Routine calls that succeed are logged at debug (issue 26 item 6); failed ones at info.
    assert [c["method"] for c in calls if c.get("level") != "debug"] == \
        ["Show", "Show", "Frobnicate"]
    assert all(c["uid"] == me and c["pid"] == os.getpid() for c in calls)
    assert [c["error"] for c in calls if c["method"] == "Frobnicate"] == [NO_METHOD]


def test_socket_garbage_gets_invalid_request(server: ControlServer, socket_path: Path) -> None:
    with _raw_connection(socket_path) as sock:
        reader = _Reader(sock)
        sock.sendall(b"this is not json\0")
        answer = reader.next()
        assert answer == {"error": INVALID, "parameters": {"message": "message is not JSON"}}
        # still usable afterwards, and two calls in one write get two answers in order
        sock.sendall(encode({"method": "org.varlink.service.GetInfo"})
                     + encode({"method": "io.oomguard.Nope"}))
        first = reader.next()
        assert first is not None and first["parameters"]["vendor"] == "oomguard"
        second = reader.next()
        assert second is not None and second["error"] == NO_METHOD


def test_socket_oversized_message_is_rejected_and_closed(
        server: ControlServer, socket_path: Path, notes: list[tuple[str, dict[str, Any]]]) -> None:
    with _raw_connection(socket_path) as sock:
        sock.sendall(b"x" * (70 * 1024))  # no NUL: never a complete frame
        answer = _Reader(sock).next()
        assert answer is not None
        assert answer["error"] == INVALID
        assert answer["parameters"]["message"].startswith("message larger than")
        assert sock.recv(1) == b""  # the server hung up
    assert any(event == "control.rejected" for event, _ in notes)


def test_stop_removes_socket(socket_path: Path, service: Service) -> None:
    srv = start_quick(ControlServer(socket_path, service))
    with ControlClient(socket_path) as client:
        assert "checkpoints" in client.call("List")
    srv.stop()
    assert not socket_path.exists()
    with pytest.raises(DaemonUnavailable):
        ControlClient(socket_path)


def test_second_server_on_same_path_refused(server: ControlServer, socket_path: Path,
                                            service: Service) -> None:
    with pytest.raises(OSError, match="another oomguard daemon answers"):
        ControlServer(socket_path, service)
    assert socket_path.is_socket()  # the first one's socket is left in place, and still answers
    with ControlClient(socket_path) as client:
        assert "checkpoints" in client.call("List")


def test_stale_socket_is_replaced(socket_path: Path, service: Service) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path))  # bound, never listening: a previous run's leftover
    stale.close()
    assert socket_path.is_socket()
    srv = start_quick(ControlServer(socket_path, service))
    try:
        with ControlClient(socket_path) as client:
            assert "checkpoints" in client.call("List")
    finally:
        srv.stop()
    assert not socket_path.exists()


def test_client_without_daemon(socket_path: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="no oomguard daemon on"):
        ControlClient(socket_path)


# -- GpuResume -----------------------------------------------------------------------------------

class ResumingGpu:
    drives_cuda = True
    why = "test"

    def __init__(self) -> None:
        self.resumed: list[list[int]] = []

    def resume(self, pids: list[int]) -> None:
        self.resumed.append(list(pids))


@pytest.mark.parametrize(("uid", "pid", "allowed"), [
    (ALICE, ALICE_PID, True), (0, BOB_PID, True), (ALICE, BOB_PID, False), (BOB, ALICE_PID, False),
])
def test_gpu_resume_only_for_the_owner_or_root(service: Service, uid: int, pid: int,
                                               allowed: bool) -> None:
    gpu = ResumingGpu()
    service.checkpointer = SimpleNamespace(gpu=gpu)  # type: ignore[assignment]
    message = call(service, uid, "io.oomguard.GpuResume", pid=pid)
    if allowed:
        assert message == {"parameters": {"pid": pid}} and gpu.resumed == [[pid]]
    else:
        assert err(message) == (DENIED, f"process {pid} is not yours")
        assert gpu.resumed == []


def test_gpu_resume_without_cuda_checkpoint_says_why(service: Service) -> None:
    service.checkpointer = SimpleNamespace(gpu=SimpleNamespace(  # type: ignore[assignment]
        drives_cuda=False, why="NVML: NVML Shared Library Not Found"))
    kind, text = err(call(service, 0, "io.oomguard.GpuResume", pid=ALICE_PID))
    assert kind == FAILED and "no cuda-checkpoint here: NVML" in text


def test_a_refused_connection_is_a_control_error_with_the_daemons_reason(
        server: ControlServer, socket_path: Path) -> None:
    """Refused at once (the reason sent, the connection closed before the call is read): the
    client raises the daemon's error, never a BrokenPipeError or ConnectionResetError."""
    server.limiter = ConnectionLimiter(total=1, per_uid=1, reserve=0)
    with ControlClient(socket_path) as held:
        assert "status" in held.call("Status")
        for closed_first in (True, False):
            with ControlClient(socket_path) as refused:
                if closed_first:  # the daemon has hung up before the call is sent: EPIPE
                    poller = select.poll()
                    poller.register(refused.sock, select.POLLRDHUP)
                    assert poller.poll(10_000)
                with pytest.raises(ControlError) as caught:
                    refused.call("Status")
                assert caught.value.name == "io.oomguard.TooManyConnections"
                assert "1 connections" in str(caught.value)


# -- a paged-out tree: Show -----------------------------------------------------------------------


def _paged_out_of_bob(store: Store) -> PagedOutTree:
    tree = PagedOutTree(id=f"po-{BOB_PID}-1700000000000", root_pid=BOB_PID,
                        tasks=((BOB_PID, 1), (BOB_CHILD, 2)), uid=BOB, cgroup="/jobs/a",
                        since=1700000000.0, paged_bytes=200 << 20, resident_bytes=230 << 20,
                        command="bobjob", swap_files=())
    PagedOutRecord(store.root).add(tree)
    return tree


@pytest.mark.parametrize("uid", [BOB, 0])
@pytest.mark.parametrize("key", ["id", "root", "child"])
def test_show_a_paged_out_tree_by_its_id_or_a_pid_to_its_owner_or_root(
        service: Service, store: Store, uid: int, key: str) -> None:
    tree = _paged_out_of_bob(store)
    asked = {"id": tree.id, "root": str(BOB_PID), "child": str(BOB_CHILD)}[key]
    shown = call(service, uid, "io.oomguard.Show", id=asked)["parameters"]["checkpoint"]
    assert shown["state"] == "paged-out" and shown["id"] == tree.id
    assert shown["pid"] == BOB_PID and shown["paged_bytes"] == 200 << 20
    text = paged_out_detail(shown)
    assert f"oomguard resume {tree.id}" in text and "200.0MiB" in text.replace(" ", "")


def test_another_user_is_not_shown_a_paged_out_tree(service: Service, store: Store) -> None:
    tree = _paged_out_of_bob(store)
    code, message = err(call(service, ALICE, "io.oomguard.Show", id=tree.id))
    assert code == NOT_FOUND and "bobjob" not in message and "200" not in message
