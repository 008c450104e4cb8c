"""A job typed at a shell prompt that CRIU cannot dump is paged out by the default chain
(["checkpoint", "pageout"], no `actions` in the rule), and nothing typed at the prompt runs it
into memory that is not there (issue 29): in a real terminal (tmux, an interactive bash), the
job joins a guarded cgroup as cgexec would, holds a Unix connection to a server outside its
tree, and grows past the threshold.

- cgroup v1 (this host): the page-out holds it with SIGSTOP, so its shell has its prompt back
  and a `fg` typed there continues it; the daemon stops it again at once (pageout.restopped).
- cgroup v2 (the v2 lane): the page-out holds it in a frozen cgroup of its own; a `fg` typed
  meanwhile waits, the job makes no progress, and nothing has to stop it again.

Once its memory fits (the limit raised) the daemon continues it; `fg` brings it to the
foreground (where it is not there already) and it counts on to its end with its memory
intact, the same process, never killed."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from oomguard.act.swapfiles import SwapFiles
from oomguard.store.names import SWAP_DIR
from tests.helpers import (
    CgroupFactory,
    DaemonProcess,
    MiB,
    close_server,
    kill_pid,
    outside_server,
    short_socket_path,
    wait_until,
)
from tests.integration.test_pageout_chain import CHUNKS, LIMIT, _counts, _swap_kib, held
from tests.terminals import PROMPT, tmux_shell

pytestmark = pytest.mark.integration


def _config(path: Path, store: Path, socket: Path, cgroup: Path) -> Path:
    """No `actions`: the default chain."""
    path.write_text(f'[daemon]\nstore = "{store}"\nsocket = "{socket}"\n\n[[guard]]\n'
                    f'cgroups = ["{cgroup}"]\nrestore_quiet = "1s"\n')
    return path


def test_a_job_typed_at_a_prompt_is_paged_out_by_default_and_fg_cannot_run_it_early(
        cgroups: CgroupFactory, store: Path, tmp_path: Path) -> None:
    cg = cgroups.make("shellpo", LIMIT)
    peer = short_socket_path().with_name("peer.sock")
    server, accepted = outside_server(peer)
    log = tmp_path / "job.log"
    socket = short_socket_path()
    config = _config(tmp_path / "oomguard.toml", store, socket, cg.path)
    guard = DaemonProcess(store, tmp_path / "daemon.log", config=config, socket=socket)
    job = 0
    try:
        guard.wait_event("guard.ready")
        env = {**os.environ, "OOMGUARD_CONFIG": str(config)}
        with tmux_shell(f"ogpo{tmp_path.name[-10:]}", tmp_path, env=env) as shell:
            prompts = shell.prompts()
            shell.type(f"sh -c 'echo $$ > {cg.path}/cgroup.procs && exec {sys.executable} "
                       f"{CHUNKS} --log {log} --target 232 --count 400 --link {peer}'")
            paged = guard.wait_event("victim.paged_out", timeout=90)[0]
            job = int(paged["pid"])
            tried = guard.events("checkpoint.failed") + guard.events("checkpoint.refused")
            assert [e["then"] for e in tried] == ["pageout"], tried  # the default's next step
            assert held(job) and _swap_kib(job) << 10 >= 190 * MiB
            assert cg.snapshot().usage_bytes < int(LIMIT * 0.85)

            if cg.version == 1:  # held by SIGSTOP: a stopped job to its shell
                assert paged["held_by"] == "SIGSTOP", paged
                shell.wait_prompt(prompts + 1)
                shell.type("fg")  # the person's natural move: continues it...
                again = guard.wait_event("pageout.restopped", timeout=30)[0]
                assert again["stopped"] == [job], again  # ...and it is stopped again
                shell.wait_prompt(prompts + 2)  # (the shell says Stopped once more)
            else:  # held by its own frozen cgroup
                assert str(paged["held_by"]).startswith("cgroup.freeze "), paged
                if shell.prompts() > prompts:  # the checkpoint's stop gave the prompt back
                    shell.type("fg")  # waits: a frozen job takes no SIGCONT
            at = _counts(log)[-1]
            time.sleep(2)  # a while in which nothing may run it
            assert held(job) and _counts(log)[-1] == at, _counts(log)[-3:]
            assert not (cg.version == 2 and guard.events("pageout.restopped"))

            cg.set_limit(2 * LIMIT)  # room again: the daemon continues it
            resumed = guard.wait_event("pageout.resumed", timeout=60)[0]
            assert resumed["auto"] is True and resumed["continued"] == [job], resumed
            if shell.screen().rstrip().endswith(PROMPT.rstrip()):  # continued in the background
                shell.type("fg")
            assert wait_until(lambda: "done 400" in log.read_text(), 90), log.read_text()[-200:]
            assert "done 400 ok" in log.read_text()
            assert _counts(log) == list(range(1, 401))  # on from where it was held, none lost
            assert wait_until(lambda: not Path(f"/proc/{job}").exists()
                              or Path(f"/proc/{job}/stat").read_text().split(") ")[1][0] in "ZX",
                              30)
            screen = shell.screen()
            assert "Killed" not in screen, screen[-2000:]
            shown = [line.split("  ")[0].strip() for line in screen.splitlines()
                     if line.startswith(("[1]", PROMPT))]
            print(f"\n[pageout-shell v{cg.version}] the terminal showed: {' | '.join(shown)}")
            assert not guard.events("victim.killed")
            assert SwapFiles(store / SWAP_DIR).ours() == []
        assert accepted, "the job never connected to the server outside its tree"
    finally:
        guard.stop()
        if job:
            kill_pid(job)
        close_server(server, accepted)
        for area in SwapFiles(store / SWAP_DIR).ours():
            SwapFiles(store / SWAP_DIR).remove(Path(area.path))
