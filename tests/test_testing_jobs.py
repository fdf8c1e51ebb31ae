"""mtc.testing's multi-controller jobs: docs/testing.md's script as written, one JAX
process per host inside the host, resumes after a host's RAM disk is wiped where an
uninterrupted job ends; the job's output readers are joined."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from doc_blocks import python_block

from mtc.testing import ScriptError, jobs, local_cluster
from mtc.testing.jobs import _wait

pytestmark = pytest.mark.process  # hosts and JAX processes



def doc_script() -> str:
    """docs/testing.md's multi-controller script, as written."""
    return python_block("docs/testing.md", "## One process per host")


def said(out: str) -> list[str]:
    """The script's own lines (JAX's gloo prints to stdout too)."""
    return [line for line in out.splitlines() if line.startswith(("resumed ", "done "))]


def test_a_job_resumes_after_a_wiped_host(tmp_path: Path, shm_base: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(doc_script())
    with local_cluster(slices=2, hosts_per_slice=1, base=shm_base,
                       backup_every_steps=10) as cluster:
        first = cluster.run_job([str(script), "20"])
        assert [said(r.stdout)[0].split()[:2] for r in first] == [["done", "20"]] * 2
        cluster.wait_replicated(20, timeout=30)
        cluster.wait_backed_up(20, timeout=30)  # every 10 steps, unasked
        cluster.wipe_ram_disk(1)

        second = [said(r.stdout) for r in cluster.run_job([str(script), "30"])]
        assert second[0][0] == "resumed 20 [(0, 'local')]", second
        assert second[1][0] == "resumed 20 [(1, 'peer')]", second
        reference = cluster.run_job([str(script), "30"], reference=tmp_path / "reference")
        assert second[0][-1] == second[1][-1] == said(reference[0].stdout)[-1]
        assert second[0][-1].startswith("done 30 ")

        failing = tmp_path / "fails.py"
        failing.write_text("import os, sys\nprint('host', os.environ['MTC_TESTING_PROCESS'], "
                           "file=sys.stderr)\nsys.exit(3 * (os.environ['MTC_TESTING_PROCESS'] "
                           "== '1'))\n")
        with pytest.raises(ScriptError, match=r"^process 1 on host 1 \(\S+\) failed first, "
                           r"with exit status 3\n"):
            cluster.run_job([str(failing)])


def test_the_output_readers_are_joined_and_a_reader_error_is_raised() -> None:
    threads = {t.name for t in threading.enumerate()}
    say = [subprocess.Popen([sys.executable, "-c", f"print({k})"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
           for k in range(2)]
    assert _wait(say, 60) == [("0\n", ""), ("1\n", "")]
    assert {t.name for t in threading.enumerate()} <= threads  # no mtc-job-* reader left
    # Output that is not text (run_job reads it as text): its reader fails, loudly.
    garbled = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.buffer."
                                 "write(bytes([255]))"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)]
    with pytest.raises(UnicodeDecodeError):
        _wait(garbled, 60)
    assert {t.name for t in threading.enumerate()} <= threads


def test_a_failed_job_names_the_first_process_to_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Process 2 exits 3; process 0 fails later waiting on it (a collective's timeout),
    process 1 would wait forever and is SIGKILLed by the harness: the error blames
    process 2, its host and its exit status, not process 0's -9 or 1."""
    monkeypatch.setattr(jobs, "FAILURE_GRACE_S", 2.0)
    codes = ["import time; time.sleep(0.8); raise SystemExit(1)",
             "import time; time.sleep(60)",
             "import sys, time; time.sleep(0.2); print('boom', file=sys.stderr); "
             "raise SystemExit(3)",
             "pass"]
    procs = [subprocess.Popen([sys.executable, "-c", c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
             for c in codes]
    failed: list[int] = []
    outs = _wait(procs, 60, failed)
    assert failed == [2, 0]
    done = [subprocess.CompletedProcess(p.args, p.returncode, o, e)
            for p, (o, e) in zip(procs, outs, strict=True)]
    assert [d.returncode for d in done] == [1, -9, 3, 0]
    where = [f"host {h} (10.0.0.{h + 1})" for h in range(4)]
    error = jobs.job_error(done, failed, where, ["train.py"], 60)
    assert error is not None and error.returncode == 3
    message = str(error)
    assert message.startswith("process 2 on host 2 (10.0.0.3) failed first, with exit "
                              "status 3; then processes [0, 1] stopped"), message
    assert "boom" in message
    assert jobs.job_error(done[3:], [], where[3:], ["train.py"], 60) is None
    # Past the job's timeout with nothing failed: every process still running is named.
    late = jobs.job_error([subprocess.CompletedProcess([], -9, "", ""),
                           subprocess.CompletedProcess([], 0, "", "")], [], where[:2],
                          ["train.py"], 5)
    assert late is not None and "timeout (5s): processes [0] (host 0 (10.0.0.1))" in str(late)


def test_the_failed_process_s_exception_is_in_the_first_lines() -> None:
    """The second newcomer trial: a job restarted with replicator 1 dead failed with
    ``process 2 on host 2 (...) failed first, with exit status 1`` first; what it
    raised (an AgreementError naming rank 1 and host 1) only thousands of characters
    below, behind its traceback. The exception's line comes second, after the
    process's name; the last one raised (a chain's), its first line."""
    trace = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
             "    f()\nmtc.errors.PeerError: PrepareRestore failed (host 2)\n\n"
             "The above exception was the direct cause of the following exception:\n\n"
             "Traceback (most recent call last):\n  File \"job.py\", line 16, in <module>\n"
             "    mgr.latest_step()\nmtc.errors.AgreementError: no restore request yet "
             "from rank(s) [1] (host 1)\nsecond line of its message\n")
    done = [subprocess.CompletedProcess([], 1, "", "x" * 9000),
            subprocess.CompletedProcess([], 1, "", "[Gloo] noise\n" + trace + "x" * 9000)]
    where = ["host 0 (10.0.0.1)", "host 1 (10.0.0.2)"]
    error = jobs.job_error(done, [1, 0], where, ["job.py"], 60)
    assert error is not None
    first, second = str(error).splitlines()[:2]
    assert first.startswith("process 1 on host 1 (10.0.0.2) failed first, with exit "
                            "status 1; then processes [0] stopped"), first
    assert second == ("process 1 raised mtc.errors.AgreementError: no restore request "
                      "yet from rank(s) [1] (host 1)"), second
    # No traceback (os._exit, a signal): nothing is made up.
    plain = [subprocess.CompletedProcess([], 3, "", "boom\n")]
    error = jobs.job_error(plain, [0], where[:1], ["job.py"], 60)
    assert error is not None and "raised" not in str(error).splitlines()[1], str(error)


def test_a_job_comes_back_on_fewer_hosts_as_the_page_says(tmp_path: Path, shm_base: Path) -> None:
    """docs/testing.md: a lost slice not replaced; the job comes back on the host left
    (run_job(hosts=[1])), one process restoring onto its smaller mesh, the lost
    host's data from the copy host 1 held, and ends where a reference run ends."""
    script = tmp_path / "job.py"
    script.write_text(doc_script())
    with local_cluster(slices=2, hosts_per_slice=1,
                       base=shm_base) as cluster:
        first = cluster.run_job([str(script), "20"])
        assert [said(r.stdout)[-1].split()[:2] for r in first] == [["done", "20"]] * 2
        cluster.wait_replicated(20, timeout=30)
        cluster.lose_slice(0)
        (back,) = [said(r.stdout) for r in cluster.run_job([str(script), "30"], hosts=[1])]
        assert back[0] == "resumed 20 [(0, 'peer')]", back
        (reference,) = cluster.run_job([str(script), "30"], hosts=[1],
                                       reference=tmp_path / "reference")
        assert back[-1] == said(reference.stdout)[-1] and back[-1].startswith("done 30 ")


def test_a_job_restarted_with_a_replicator_dead_names_it_in_every_process(
        tmp_path: Path, shm_base: Path) -> None:
    """Issue 68, item 6: 4 processes, rank 1's replicator dead at the restart. Every
    process fails with a typed AgreementError naming rank 1's replicator and its
    address; none names rank 0, which asked."""
    import re

    script = tmp_path / "job.py"
    # Each process waits out its restore's deadline (the dead replicator never
    # answers): short, but far beyond the few seconds between the processes' starts,
    # so that at each one's deadline every live rank has asked and only rank 1 is absent.
    script.write_text(doc_script().replace("join_job(save_interval_steps=10)",
                                           "join_job(save_interval_steps=10, "
                                           "restore_timeout_s=10)"))
    with local_cluster(slices=2, hosts_per_slice=2,
                       base=shm_base) as cluster:
        cluster.run_job([str(script), "20"])
        cluster.wait_replicated(20, timeout=30)
        cluster.kill_replicator(1)
        dead = cluster.local.addresses[1]
        with pytest.raises(ScriptError) as raised:
            cluster.run_job([str(script), "30"])
    error = raised.value
    first = int(re.match(r"process (\d+) ", error.note).group(1))  # type: ignore[union-attr]
    parts = re.split(r"\n--- process (\d+) on [^\n]* stderr ---\n", error.stderr)
    stderr = {first: parts[0], **{int(k): v for k, v in zip(parts[1::2], parts[2::2],
                                                            strict=True)}}
    assert sorted(stderr) == [0, 1, 2, 3], error.note
    for k, text in stderr.items():
        last = [x for x in text.splitlines() if x.startswith("mtc.errors.")][-1:]
        assert last and last[0].startswith("mtc.errors.AgreementError: "), (k, text[-2000:])
        assert dead in last[0] and "rank 1" in last[0], (k, last)
        assert "[0, 1]" not in last[0], (k, last)
