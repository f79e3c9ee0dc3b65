"""Runs seen from the Makefile: a failed run's one line and record (`mark-failed`), and
`make smoke`."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import common
from report.results_table import flag_groups, max_loss_diff, over_tolerance, why_not_compared

_SCRIPT_ERROR = re.compile(r"^(\S+\.py: error: .*|rank \d+ failed: .*)$", re.M)
_FIRST_DEATH = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.*)$", re.M)
_BUSY_PORT = re.compile(r"port: (\d+)\b.*EADDRINUSE")


def launcher_error(output: str) -> str | None:
    """torchrun's own failure, before any rank started (a traceback through torchrun and no
    rank's failure listed), in one line; a busy port says how to choose another."""
    if "distributed/run.py" not in output or "ChildFailedError" in output \
            or not (errors := _EXCEPTION_LINE.findall(output)):
        return None
    name, message = errors[-1]
    if busy := _BUSY_PORT.search(message):
        return f"port {busy[1]} is busy (another run on this host?), no rank started: " \
            f"choose another with MASTER_PORT=<n> (unset, a one-node run takes a free one)"
    return f"torchrun failed before any rank started: {name}: {message}"


def failure_line(output: str, exit_code: int) -> str:
    """A failed run's cause in one line, from its output: the script's own error (a refused
    flag, or the line `run_main` prints before a traceback), else torchrun's own (a busy
    port: no rank started), else what torchrun saw of the first rank to die (a crash, a
    kill), else the exit code."""
    if found := _SCRIPT_ERROR.search(output):
        return found.group(1)
    if launcher := launcher_error(output):
        return launcher
    # torchrun lists the other ranks' failures first, then the "Root Cause" (the first to die)
    found = _FIRST_DEATH.search(output, max(0, output.find("Root Cause")))
    who, code = (f"rank {found[1]}", int(found[2])) if found else ("a rank", exit_code)
    if code < 0:
        return f"{who} was killed by signal {-code}"
    return f"{who} exited with code {code}"


def _own_record(results: Path, script: Path, variant: str | None, since: float) -> dict | None:
    """The record the run of `script` (with `variant`) begun at `since` wrote, if any. The
    variant's flags in any order: the command line's is the run list's, the record's the
    order the script defines them (`--long-run --moe-balance none` is `--moe-balance none
    --long-run`)."""
    since_time = datetime.datetime.fromtimestamp(int(since), datetime.UTC)
    return next((rec for rec in reversed(common.load_results(results))
                 if (rec.get("folder"), rec.get("script"), flag_groups(rec.get("variant"))) ==
                 (script.resolve().parent.name, script.stem, flag_groups(variant))
                 and datetime.datetime.fromisoformat(rec["time"]) >= since_time), None)


def _flags_of(script_args: Sequence[str]) -> tuple[argparse.Namespace, str | None]:
    """The shared flags of a run (for its results file and size) and its variant, also when
    the script refused them (then `--results`, `--size` read leniently and no variant)."""
    try:
        with contextlib.redirect_stderr(None):
            shared = common.parser(None)
            run_args, own_flags = shared.parse_known_args(script_args)
        return run_args, " ".join(shared.fill_shape(run_args) + own_flags) or None
    except SystemExit:
        lenient = argparse.ArgumentParser(add_help=False)
        lenient.add_argument("--results", type=Path, default=common.RESULTS)
        lenient.add_argument("--size")
        return lenient.parse_known_args(script_args)[0], None


def mark_failed(script: Path, script_args: Sequence[str], since: float, exit_code: int,
                log_path: Path, world_size: int, record: bool = True) -> str:
    """A run ended non-zero: the line to show (its output's `failure_line`), after writing a
    `failed` record when the run wrote none (a run that recorded itself keeps its own row: a
    failure's reason, or a result written before a crash in teardown)."""
    run_args, variant = _flags_of(script_args)
    own = _own_record(run_args.results, script, variant, since) if record else None
    if own and own["status"] == "failed":
        return own["reason"]
    reason = failure_line(log_path.read_text(errors="replace") if log_path.exists() else "",
                          exit_code)
    if own:
        return f"{reason}, after recording {own['status']}"
    if record:
        rec = common.base_record(run_args, None, None, "failed", reason)
        rec.update(folder=script.resolve().parent.name, script=script.stem,
                   world_size=world_size, variant=variant)
        common.append_record(run_args.results, rec)
    return reason


def _fork_rank(script: str, argv: list[str], env: dict[str, str], log_fd: int) -> int:
    """A process that runs `script` as one rank, as torchrun would start it, but forked from
    this interpreter: torch is imported once, not twice a run. CUDA cannot be used in a child
    forked after its parent initialised it, so this interpreter never touches torch.cuda."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.environ.update(env)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.argv = [script, *argv]
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def smoke(runs: Sequence[str], nproc: int, flags: Sequence[str], out: Path,
          timeout: float) -> int:
    """`make smoke`: every run (a script and its flags) once, `nproc` ranks on this host, one
    line each: ok, over tolerance (its losses strayed from its baseline's, run just before, by
    more than its script allows), skipped (why) or FAILED (its error line). Returns 1 if any
    failed."""
    results, logs = out / "results.jsonl", out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    failed, over, began = 0, 0, time.monotonic()
    width = max(map(len, runs), default=0)  # every verdict in one column
    for run in runs:
        script, *own = run.split()
        log_path = logs / (Path(script).stem + "".join(own).replace("/", "_") + ".log")
        argv = [*flags, *own, "--results", str(results)]
        since, port = time.time(), common.free_port()
        sys.stdout.flush()
        with open(log_path, "w") as log_file:
            pids = [_fork_rank(script, argv, {
                "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}, log_file.fileno()) for r in range(nproc)]
        codes, deadline = {}, time.monotonic() + timeout
        while len(codes) < nproc and time.monotonic() < deadline:
            for pid in set(pids) - set(codes):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        hung = set(pids) - set(codes)
        for pid in hung:  # past the timeout: a hang is a failure, not a wait
            os.kill(pid, signal.SIGKILL)
            codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        code = next((codes[pid] for pid in pids if codes[pid]), 0)
        own = _own_record(results, Path(script), _flags_of(argv)[1], since)
        base = next((rec for rec in reversed(common.load_results(results)) if own
                     and rec.get("script") == own.get("baseline")
                     and common.run_key(rec) == common.run_key(own)), None)
        # held to its baseline only where the report would compare them (same batch, length...)
        if code == 0 and own and own["status"] == "ok" and why_not_compared(own, base) is None \
                and over_tolerance(own, base):
            diff = max_loss_diff(own["losses"], base["losses"])
            line = f"over tolerance (max loss difference {diff:.2e} > {own['loss_tolerance']:g})" \
                if own.get("loss_tolerance_final_rel") is None else \
                f"over tolerance (final loss {own['losses'][-1]:.3f} against " \
                f"{base['losses'][-1]:.3f}, more than {own['loss_tolerance_final_rel']:.0%} apart)"
            over += 1
        elif code == 0 and own and own["status"] == "ok":
            line = f"ok ({own['step_ms']:.1f} ms/step, loss {own['losses'][-1]:.3f})" \
                if "losses" in own else f"ok ({len(own['sweep'])} sizes x ops timed)"
        elif code == 0 and own and own["status"] == "skipped":
            line = f"skipped: {own['reason']}"
        else:  # recorded by a Python of its own: this one must never touch CUDA (see above)
            reason = f"timed out after {timeout:.0f} s" if hung else subprocess.run(
                [sys.executable, "-m", "report", "mark-failed", script, "--since", str(since),
                 "--exit-code", str(code or 1), "--log", str(log_path), "--world-size",
                 str(nproc), "--", *argv], capture_output=True, text=True,
                cwd=common.ROOT).stdout.strip()
            line, failed = f"FAILED: {reason} (log: {log_path})", failed + 1
        print(f"{run:<{width}} {line}", flush=True)
    print(f"smoke: {len(runs)} runs, {failed} failed, {over} over tolerance, "
          f"{time.monotonic() - began:.0f} s ({nproc} processes each)", flush=True)
    return 1 if failed else 0
