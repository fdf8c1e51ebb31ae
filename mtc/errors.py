"""Typed errors. Every error mtc raises derives from :class:`MtcError`.

Errors are split by intent: :class:`RetryableError` means the same call may
succeed later (a peer or a bucket was unreachable, the RAM disk was full and
space may be freed); :class:`FatalError` means retrying the same call cannot
help (bad input, corrupt data). Each error names the step, host and file when
they are known, so an operator can act on the message alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


class MtcError(Exception):
    """Base of every error raised by mtc."""

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        host: int | None = None,
        path: str | None = None,
    ) -> None:
        self.message = message
        self.step = step
        self.host = host
        self.path = path
        where = []
        if step is not None:
            where.append(f"step {step}")
        if host is not None:
            where.append(f"host {host}")
        if path is not None:
            where.append(f"file {path}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class RetryableError(MtcError):
    """The operation may succeed if retried later."""


class FatalError(MtcError):
    """Retrying the same operation cannot succeed."""


class RamDiskFullError(RetryableError):
    """The RAM disk ran out of space while writing a step; the step was discarded."""


class StorageError(RetryableError):
    """An I/O error other than a full disk while reading or writing a step."""


class AgreementError(RetryableError):
    """Hosts could not agree on the step to restore."""


class SaveInProgressError(RetryableError):
    """A save could not be staged because host memory in flight is exhausted."""


class CorruptShardError(FatalError):
    """A file's bytes do not match the checksum or size in its manifest."""


class ManifestError(FatalError):
    """A manifest is missing, unreadable, or of an unsupported version."""


class StepNotFoundError(FatalError, FileNotFoundError):
    """The requested step is not committed on every host that needs it (also a
    ``FileNotFoundError``, what Orbax raises there: users' ``except`` clauses hold)."""


class StepExistsError(FatalError, ValueError):
    """A step with this number is already committed or being written (a
    ``ValueError``, and where Orbax is loaded its ``StepAlreadyExistsError`` itself:
    ``mtc.orbax_args.step_exists``)."""


class MixedRunError(FatalError):
    """A step's hosts hold bytes written by different runs of the job (a step saved
    again under the same number after a restore, while an earlier run's save of it
    survived on some hosts): it is never restored."""


class DataLossError(FatalError):
    """Some hosts' data of every step is gone (their RAM disks, their peers' copies
    and the backup) while other hosts still hold steps: nothing can be restored
    consistently. The message names the steps and the ranks whose data is gone;
    ``Options(if_data_lost="start_over")`` starts from scratch instead."""


class ShardUnavailableError(FatalError):
    """A restore (``restore``, ``latest_step``) found no readable copy of part of an
    array the target needs, or a host's sidecar did not answer a call that is not a
    save (``all_steps``, ``delete``, ``metrics``, a restore's reads); a save raises
    ``SaveError`` instead."""


class SaveError(FatalError):
    """A save (``save``, ``wait_until_finished``) could not reach a host's sidecar:
    the host, or its process, was lost or restarted, and the step is not committed
    there. The message names the step, the host and this process; the dispatch's
    :class:`ShardUnavailableError` is its ``__cause__``."""


class TargetMismatchError(FatalError, ValueError):
    """The restore target disagrees with the saved tree (shape, dtype or structure);
    also a ``ValueError``, as Orbax raises there."""


class UnsupportedLeafError(FatalError):
    """A leaf of the state has a type mtc cannot save."""


class ConfigError(FatalError, ValueError):
    """Options or topology are inconsistent, or a call's arguments are not usable
    (also a ``ValueError``, as Orbax raises for misuse)."""


class InvalidStepError(FatalError, ValueError):
    """A step number is not a non-negative integer (also a ``ValueError``)."""


class ClosedError(FatalError):
    """The manager was closed; no call but ``close()`` may follow."""


class DirectoryLockedError(FatalError):
    """A checkpoint manager of another process holds this host's directory, or (at
    ``save``) another manager of this process has a save of it in flight."""


class LocalDirError(FatalError):
    """``local_dir`` (a host root in it) cannot be created, read or written."""


class HostAgentError(FatalError):
    """Host-side code answered inconsistently (workers disagreeing on one call)."""


class ColocatedCallError(HostAgentError):
    """A colocated-Python call failed on a worker: the function raised, named a
    device the worker does not have, or returned what its declared specs do not
    allow (as the real runtime refuses it)."""


class ProtocolError(FatalError):
    """A malformed request or reply crossed the host seam."""


class UnsafePathError(FatalError):
    """A path from a request or a peer would leave the folder it names a file of
    (``..``, an absolute path, a symlink), or is too long to be a file's."""


class UnauthorizedError(FatalError):
    """The caller may not make this call: its certificate names another rank than
    the one it acts for, or no rank where only a peer replicator may call."""


class BusyError(RetryableError):
    """A server has no room for this call now (streams, transfers or RAM disk space
    are at their bound); the same call may succeed later."""


class SnapshotUnavailableError(MtcError, RuntimeError):
    """No snapshot can be loaded: none was taken, or no surviving device holds some
    shard of it. A ``RuntimeError``, as Orbax's ``Snapshotter.load`` raises."""


class BackupUnavailableError(RetryableError):
    """The backup store could not be reached or answered with a transient error."""


class CorruptBackupError(CorruptShardError):
    """An object's bytes do not match their recorded CRC32C or size."""


class HolderIdle(RetryableError):
    """The host meant to read a shared object from the backup for the others is not
    restoring this step (any more): the others read it from the store themselves."""


class PeerError(RetryableError):
    """A peer could not be reached or refused a call; ``code`` is the gRPC status.
    Whether sending it again can help is :func:`~mtc.grpc_errors.is_retryable`
    (a refusal such as INVALID_ARGUMENT or DATA_LOSS is not), and ``kind`` is the
    domain error the code stands for, from the same map the server used
    (``mtc/grpc_errors.py``, imported only when asked: this module imports nothing)."""

    code: grpc.StatusCode | None = None

    @property
    def unreachable(self) -> bool:
        from mtc.grpc_errors import TRANSIENT

        return self.code in TRANSIENT or self.code is None

    @property
    def kind(self) -> type[MtcError]:
        from mtc.grpc_errors import error_class

        return error_class(self.code)
