"""Telling Slurm: a job step checkpointed instead of OOM-killed looks, to Slurm, like a job that
died of SIGKILL for no reason. So oomguard writes what happened into the job's AdminComment and,
per config, requeues it (held or not) so that the scheduler, not oomguard, decides where it
runs next; the requeued job's batch script then calls `oomguard resume-job`.

scontrol is the only interface used (no REST daemon needed); its runner is injected."""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass

from oomguard.model.errors import OomguardError
from oomguard.model.runner import CommandRunner, SubprocessRunner

AFTER_CHECKPOINT = ("none", "requeue", "requeuehold")
SCONTROL_CANDIDATES = ("/usr/bin/scontrol", "/usr/local/bin/scontrol")


class SlurmError(OomguardError):
    """scontrol failed or is missing."""


def find_scontrol(configured: str = "auto") -> str | None:
    if configured != "auto":
        return configured if shutil.which(configured) else None
    return shutil.which("scontrol") or next(
        (c for c in SCONTROL_CANDIDATES if shutil.which(c)), None)


def admin_comment(checkpoint_id: str, step: str | None, when: float, reason: str) -> str:
    """One line, no quotes or newlines (scontrol parses it), under Slurm's comment limits."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
    what = f"step {step}" if step is not None else "job"
    text = (f"oomguard: {what} checkpointed instead of OOM-killed at {stamp}, "
            f"checkpoint {checkpoint_id} ({reason}); resume with: oomguard resume-job")
    return " ".join(text.replace('"', "'").split())[:1000]


def job_memory_mib(show_job: str) -> int | None:
    """MinMemoryNode (or MinMemoryCPU) from `scontrol show job` output, in MiB."""
    match = re.search(r"\bMinMemory(?:Node|CPU)=(\d+)([KMGT]?)", show_job)
    if not match:
        return None
    factor = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match[2]]
    return int(int(match[1]) * factor)


@dataclass
class SlurmNotifier:
    scontrol: str
    after_checkpoint: str = "none"  # none | requeue | requeuehold
    grow_memory: float = 1.0  # the requeued job asks for this many times its memory
    runner: CommandRunner | None = None
    timeout: float = 30.0

    def _run(self, *args: str) -> str:
        runner = self.runner or SubprocessRunner()
        argv = [self.scontrol, *args]
        try:
            result = runner.run(argv, timeout=self.timeout)
        except OSError as exc:
            raise SlurmError(f"{' '.join(argv)}: {exc}") from exc
        if result.timed_out:
            raise SlurmError(f"{' '.join(argv)}: timed out after {self.timeout:g}s")
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip()[-500:]
            raise SlurmError(f"{' '.join(argv)}: exit status {result.returncode}: {detail}")
        return result.stdout

    def annotate(self, job_id: int, comment: str) -> None:
        self._run("update", f"JobId={job_id}", f"AdminComment={comment}")

    def notify(self, job_id: int, step: str | None, checkpoint_id: str, when: float,
               reason: str) -> list[str]:
        """Returns what was done. Raises SlurmError. By the time a checkpoint is complete its
        job step has ended, and Slurm takes no AdminComment on a finished job: with a requeue
        configured the job is first requeued held (pending again), then commented, given more
        memory if asked, and released unless `requeuehold` was asked for."""
        comment = admin_comment(checkpoint_id, step, when, reason)
        if self.after_checkpoint == "none":
            self.annotate(job_id, comment)
            return ["admin_comment"]
        current = job_memory_mib(self._run("show", "job", str(job_id))) \
            if self.grow_memory > 1.0 else None
        self._run("requeuehold", str(job_id))
        done = ["requeuehold"]
        self.annotate(job_id, comment)
        done.append("admin_comment")
        if current:
            wanted = int(current * self.grow_memory)
            self._run("update", f"JobId={job_id}", f"MinMemoryNode={wanted}")
            done.append(f"memory {current}M -> {wanted}M")
        if self.after_checkpoint == "requeue":
            # Slurm defers a requeued job's start (against restart loops); this one has been
            # dealt with: it may start at once.
            self._run("update", f"JobId={job_id}", "StartTime=now")
            self._run("release", str(job_id))
            done.append("released")
        return done
