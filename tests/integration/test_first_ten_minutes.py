"""README's "Your first ten minutes", run exactly as written: the block between the
first-ten-minutes markers goes to bash with only its paths moved (the cgroup beneath this
test's own memory cgroup, /etc/oomguard, the store, the socket, the log and the metrics port
into a scratch directory) and `oomguard` first on PATH from this checkout."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.helpers import REPO, CgroupFactory, kill_pid, read_counts, wait_until

BEGIN, END = "<!-- first-ten-minutes:begin -->", "<!-- first-ten-minutes:end -->"
README_CGROUP = "/sys/fs/cgroup/memory/demo"


def readme_walkthrough() -> str:
    text = (REPO / "README.md").read_text()
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert block.startswith("```sh\n") and block.endswith("```"), block[:40]
    return block[len("```sh\n"):-len("```")]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def moved(script: str, paths: dict[str, str]) -> str:
    for old, new in paths.items():
        assert old in script, f"README's walkthrough no longer mentions {old}"
        script = script.replace(old, new)
    return script


def walkthrough_moved(cgroup: Path, tmp_path: Path) -> tuple[str, Path, Path]:
    """README's walkthrough with its paths in `tmp_path` (the cgroup beneath the test's own,
    a free metrics port): (the script, the config's directory, the working directory)."""
    etc, work = tmp_path / "etc-oomguard", tmp_path / "home"
    work.mkdir()
    script = moved(readme_walkthrough(), {
        README_CGROUP: str(cgroup),
        "/etc/oomguard": str(etc),
        "/var/lib/oomguard": str(tmp_path / "store"),
        "/run/oomguard/control.sock": str(tmp_path / "control.sock"),
        "/var/log/oomguard-demo.log": str(tmp_path / "daemon.log"),
        "9464": str(free_port()),
    })
    return script, etc, work


def test_readme_first_ten_minutes_as_written(cgroups: CgroupFactory, tmp_path: Path) -> None:
    demo = cgroups.make("demo", None)  # the README's mkdir -p finds it; its echo sets the limit
    script, etc, work = walkthrough_moved(demo.path, tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           # the README relies on /etc/oomguard/oomguard.toml being found: moved, it is found so
           "OOMGUARD_CONFIG": str(etc / "oomguard.toml")}
    env.pop("OOMGUARD_SOCKET", None)
    result = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True,
                            text=True, timeout=240, stdin=subprocess.DEVNULL)
    out = result.stdout
    shown = f"stdout:\n{out}\nstderr:\n{result.stderr}\ndaemon log:\n" + (
        (tmp_path / "daemon.log").read_text() if (tmp_path / "daemon.log").exists() else "")
    assert result.returncode == 0, shown
    # 2: the config checks out and the daemon guards the cgroup
    assert "OK (1 guard rule(s))" in out, shown
    assert "daemon: running" in out and str(demo.path) in out, shown
    # 3: exec reported the checkpoint
    assert "exit status 75" in out, shown
    # 4: list / show name it; the job had stopped counting part-way
    ids = set(re.findall(r"\b(\d{8}-\d{6}-\d+-[0-9a-f]+)\b", out))
    assert len(ids) == 1, shown
    assert re.search(r"^state +checkpointed$", out, re.M), shown
    # 5: restored, and the same process went on: every number once, in order, then done
    assert re.search(r"restored \S+ as PID \d+ \(was \d+\)", out + result.stderr), shown
    log = work / "demo.log"
    assert read_counts(log) == list(range(100)), log.read_text()
    assert log.read_text().rstrip().endswith("done"), log.read_text()
    # 6: the metrics count one checkpoint and one restore
    metrics = dict(re.findall(r"^(oomguard_\w+_total\{[^}]*\}) (\S+)$", out, re.M))
    assert any(k.startswith("oomguard_checkpoints_total") and float(v) >= 1
               for k, v in metrics.items()), shown
    assert any(k.startswith("oomguard_restores_total") and "failed" not in k and float(v) >= 1
               for k, v in metrics.items()), shown


def readme_blocks(script: str) -> list[str]:
    """The walkthrough's numbered blocks (`# 1. ...` up to the next), as a person pastes them
    one at a time."""
    blocks: list[list[str]] = []
    for line in script.splitlines():
        if re.match(r"# \d+\. ", line) or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    return ["\n".join(block).strip() + "\n" for block in blocks if "".join(block).strip()]


def test_readme_first_ten_minutes_pasted_block_by_block_into_a_terminal(
        cgroups: CgroupFactory, tmp_path: Path) -> None:
    """The same walkthrough pasted into a real terminal (tmux, an interactive bash), one
    block at a time, each run to its end: nothing the shell should run is read by a job
    (`echo "exit status $?"` runs right after exec), restore attaches and ends with the job,
    and the daemon started in the background is stopped by the last block's `kill %1`."""
    from tests.terminals import pids_running, tmux_shell

    demo = cgroups.make("pasted", None)
    script, etc, work = walkthrough_moved(demo.path, tmp_path)
    env = {**os.environ, "OOMGUARD_CONFIG": str(etc / "oomguard.toml"),
           "XDG_RUNTIME_DIR": str(tmp_path)}
    env.pop("OOMGUARD_SOCKET", None)
    try:
        with tmux_shell("readme", work, env) as shell:
            for number, block in enumerate(readme_blocks(script), start=1):
                since = shell.mark()
                shell.paste(block)
                # Typed after the paste: the shell runs it once the whole block has run.
                shell.type(f"echo block-done-$(( {number} * 1000 ))")
                shell.wait_for(f"\nblock-done-{number * 1000}\n", timeout=120, since=since)
            out = shell.screen()
            stopped = wait_until(lambda: '"guard.stopped"' in (tmp_path / "daemon.log")
                                 .read_text(), 30)  # by the last block's `kill %1`
    finally:
        for pid in pids_running(str(etc / "oomguard.toml")):
            kill_pid(pid)
    shown = f"terminal:\n{out[-6000:]}\ndaemon log:\n" + (
        (tmp_path / "daemon.log").read_text() if (tmp_path / "daemon.log").exists() else "")
    assert "OK (1 guard rule(s))" in out, shown
    assert "daemon: running" in out, shown
    assert "exit status 75" in out, shown
    ids = set(re.findall(r"\b(\d{8}-\d{6}-\d+-[0-9a-f]+)\b", out))
    assert len(ids) == 1, shown
    assert re.search(r"restored \S+ as PID \d+ \(was \d+\)", out), shown
    assert "the job exited with status 0" in out, shown  # restore attached, ended with it
    log = work / "demo.log"
    assert read_counts(log) == list(range(100)), log.read_text()
    assert log.read_text().rstrip().endswith("done"), log.read_text()
    assert re.search(r"^oomguard_checkpoints_total\{[^}]*\} [1-9]", out, re.M), shown
    assert stopped, shown


# -- every other example of README.md and config/oomguard.toml, as written ---------------------

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
# README's blocks that are not run here, and why (they are run elsewhere, as written).
NOT_RUN = {"./scripts/setup": "installs system packages and builds CRIU (the machine's set-up)",
           "./scripts/test": "the whole suite, of which this test is a part",
           "# 1. A memory cgroup": "the walkthrough: the tests above"}
CONFIG = REPO / "config" / "oomguard.toml"
ASSIGNMENT = re.compile(r"^[a-z_0-9]+ = ")
HEADER = re.compile(r"^\[\[?[a-z_]+\]\]?$")


def readme_blocks_of(kind: str) -> list[str]:
    return [body for lang, body in FENCE.findall((REPO / "README.md").read_text())
            if lang == kind]


def _uncommented(line: str) -> str | None:
    """`# key = value` / `# [[guard]]` / `# # a note` as the line it stands for; else None."""
    if not line.startswith("# "):
        return None
    rest = line[2:]
    return rest if ASSIGNMENT.match(rest) or HEADER.match(rest) or rest.startswith("#") \
        else None


def config_examples(text: str) -> dict[str, str]:
    """The shipped config, and each of its commented examples put in force, one at a time:
    a commented key of a table in force (replacing the key's value there), or a commented
    table (a `# [[guard]]` block) appended as written, its notes kept as comments."""
    lines = text.splitlines()
    examples = {"as shipped": text}
    table, block, blocks = "", list[str](), list[list[str]]()
    for line in lines:
        example = _uncommented(line)
        if block and example is None:
            blocks.append(block)
            block = []
        if HEADER.match(line):
            table = line
        elif example is not None and HEADER.match(example):
            block = [example]
        elif block and example is not None:
            block.append(example)
        elif example is not None and ASSIGNMENT.match(example) and table:
            key = example.split(" = ", 1)[0]
            end = _table_end(lines, lines.index(table))
            changed = [other for i, other in enumerate(lines)
                       if not (lines.index(table) < i < end and other.startswith(f"{key} = "))]
            changed[changed.index(line)] = example
            examples[f"{table} {key}"] = "\n".join(changed) + "\n"
    for number, found in enumerate([*blocks, *([block] if block else [])], 1):
        examples[f"{found[0]} #{number}"] = text + "\n" + "\n".join(found) + "\n"
    return examples


def _table_end(lines: list[str], start: int) -> int:
    return next((i for i in range(start + 1, len(lines)) if HEADER.match(lines[i])), len(lines))


def config_moved(text: str, tmp_path: Path, cgroup: Path) -> str:
    """A config example with its paths in `tmp_path` and its cgroups the test's."""
    for old, new in {"/var/lib/oomguard": str(tmp_path / "store"),
                     "/run/oomguard/control.sock": str(tmp_path / "control.sock"),
                     "/sys/fs/cgroup/memory/jobs/build": str(cgroup),
                     "/sys/fs/cgroup/user.slice": str(cgroup),
                     "/run/systemd/oomd.prekill.hook": str(tmp_path / "prekill")}.items():
        text = text.replace(old, new)
    return text


def test_every_example_of_the_shipped_config_loads(cgroups: CgroupFactory,
                                                   tmp_path: Path) -> None:
    """config/oomguard.toml (the embedded default) as shipped and with each commented example
    put in force, one at a time: `oomguard check-config` accepts every one."""
    build = cgroups.make("build", 256 * 1024 * 1024)
    examples = config_examples(CONFIG.read_text())
    assert {"[hooks] on_checkpoint", "[daemon] oomd_prekill_dir"} <= set(examples)
    assert sum(name.startswith("[[guard]]") for name in examples) == 2
    for number, (name, text) in enumerate(examples.items()):
        path = tmp_path / f"example-{number}.toml"
        path.write_text(config_moved(text, tmp_path, build.path))
        result = subprocess.run([sys.executable, "-m", "oomguard", "check-config", str(path)],
                                capture_output=True, text=True, timeout=60, cwd=REPO,
                                stdin=subprocess.DEVNULL)
        assert result.returncode == 0, (name, result.stdout, result.stderr)
        assert f"{path}: OK" in result.stdout and "Traceback" not in result.stderr, name


def synopsis_forms(block: str) -> dict[str, tuple[list[str], list[str]]]:
    """README's synopsis: per subcommand its shortest form (every [option] left out) and its
    longest (every one given; `A|B`: A), as argv after `oomguard`, placeholders kept."""
    forms = {}
    for line in block.splitlines():
        command = line.split("  #", 1)[0].strip()
        assert command.startswith("oomguard "), line
        shortest = command
        while re.search(r"\[[^\[\]]*\]", shortest):
            shortest = re.sub(r"\[[^\[\]]*\]", "", shortest)
        longest = command.replace("[", " ").replace("]", " ")
        words = [[w.split("|")[0] for w in form.split()[1:] if w != "..."]
                 for form in (shortest, longest)]
        forms[words[0][0]] = (words[0], words[1])
    return forms


def test_readme_examples_as_written(cgroups: CgroupFactory, tmp_path: Path) -> None:
    """Every fenced block of README.md is run (but the machine's set-up, the whole suite and
    the walkthrough above): `.venv/bin/oomguard run` on the default config, and each line of
    the synopsis in its shortest and its longest form against a daemon started by its `run`
    line, with the shipped config's example hook in force (it runs, and succeeds)."""
    blocks = readme_blocks_of("sh")
    synopsis = [b for b in blocks if b.startswith("oomguard run --cgroup")]
    assert len(synopsis) == 1
    others = [b for b in blocks if b not in synopsis]
    assert others and all(any(b.startswith(k) for k in NOT_RUN) or b.strip() ==
                          ".venv/bin/oomguard run" for b in others), others
    build = cgroups.make("build", 256 * 1024 * 1024)
    bigger = cgroups.make("bigger", 768 * 1024 * 1024)
    config = tmp_path / "oomguard.toml"
    config.write_text(config_moved(config_examples(CONFIG.read_text())["[hooks] on_checkpoint"],
                                   tmp_path, build.path))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OOMGUARD_CONFIG": str(config)}
    env.pop("OOMGUARD_SOCKET", None)

    # `.venv/bin/oomguard run` (as README's "Set up, test, run" has it): idles, stops cleanly.
    idle_log = tmp_path / "idle.log"
    with open(idle_log, "wb") as out:
        idle = subprocess.Popen(["bash", "-c", "exec .venv/bin/oomguard run"], cwd=REPO,
                                env={**env, "OOMGUARD_CONFIG": str(tmp_path / "idle.toml")},
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    (tmp_path / "idle.toml").write_text(config_moved(CONFIG.read_text(), tmp_path / "i",
                                                     build.path))
    try:
        assert wait_until(lambda: "guard.ready" in idle_log.read_text(), 60), \
            idle_log.read_text()
    finally:
        idle.terminate()
        assert idle.wait(timeout=30) == 0, idle_log.read_text()[-2000:]

    forms = synopsis_forms(synopsis[0])
    values = {"/sys/fs/cgroup/memory/jobs/build": str(build.path), "PATH": str(build.path),
              "/sys/fs/cgroup/memory/jobs/bigger": str(bigger.path), "CMD": "true",
              "FILE": str(config)}
    work = tmp_path / "work"
    work.mkdir()

    def argv(form: list[str], **more: str) -> list[str]:
        return ["oomguard", *[{**values, **more}.get(w, w) for w in form]]

    def run(form: list[str], status: int = 0, **more: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(argv(form, **more), capture_output=True, text=True, env=env,
                                timeout=180, cwd=work, stdin=subprocess.DEVNULL)
        assert "Traceback" not in result.stderr, (form, result.stderr)
        assert result.returncode == status, (form, result.returncode, result.stdout,
                                             result.stderr)
        return result

    shortest, longest = {k: v[0] for k, v in forms.items()}, {k: v[1] for k, v in forms.items()}
    assert shortest["run"] == longest["run"]
    daemon_log = tmp_path / "daemon.log"
    restored: list[int] = []
    with open(daemon_log, "wb") as out:
        guard = subprocess.Popen(argv(longest["run"]), cwd=work, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    hog_log = tmp_path / "hog.log"
    hog = start_in_cgroup_log(build.path, hog_log)
    try:
        assert wait_until(lambda: "guard.ready" in daemon_log.read_text(), 60), \
            daemon_log.read_text()
        assert wait_until(lambda: read_counts(hog_log)[-1:] > [10], 30)
        first = run(shortest["checkpoint"], PID=str(hog.pid)).stdout.strip()
        assert wait_until(lambda: "hook.done" in daemon_log.read_text()
                          or "hook.failed" in daemon_log.read_text(), 30)
        assert "hook.failed" not in daemon_log.read_text(), daemon_log.read_text()[-3000:]
        hog.wait(timeout=10)
        for verb in ("list", "show"):
            for form in (shortest[verb], longest[verb]):
                assert first in run(form, ID=first).stdout
        restored.append(int(run(shortest["restore"], ID=first).stdout.split()[0]))
        second = run(shortest["checkpoint"], PID=str(restored[-1])).stdout.strip()
        restored.append(int(run(longest["restore"], ID=second).stdout.split()[0]))
        assert restored[-1] in [int(p) for p in (bigger.path / "cgroup.procs").read_text()
                                .split()]
        for form in (shortest["attach"], longest["attach"]):  # no terminal: said so
            refused = run(form, status=1, ID=second)
            assert refused.stderr.strip().count("\n") == 0 and "no terminal" in refused.stderr
        run(shortest["forget"], ID=first)
        for verb in ("exec", "status", "doctor", "check-config"):
            for form in (shortest[verb], longest[verb]):
                run(form)
        assert set(forms) == {"run", "list", "show", "restore", "attach", "checkpoint",
                              "forget", "exec", "status", "doctor", "check-config"}
    finally:
        for pid in [hog.pid, *restored]:
            kill_pid(pid)
        guard.terminate()
        assert guard.wait(timeout=60) == 0, daemon_log.read_text()[-3000:]


def start_in_cgroup_log(cgroup: Path, log: Path) -> subprocess.Popen[bytes]:
    """A small counting hog (32 MiB) in `cgroup`, as tests.helpers starts one."""
    from tests.helpers import hog_argv, start_in_cgroup

    return start_in_cgroup(SimpleNamespace(path=cgroup),  # type: ignore[arg-type]
                           hog_argv(log, target=32, rate=200, count=100_000))
