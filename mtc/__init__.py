"""mtc: multi-tier checkpointing for JAX (RAM disk, peer host, cloud storage)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mtc.errors import (
    AgreementError,
    ClosedError,
    ConfigError,
    CorruptShardError,
    DataLossError,
    DirectoryLockedError,
    FatalError,
    InvalidStepError,
    LocalDirError,
    ManifestError,
    MixedRunError,
    MtcError,
    RamDiskFullError,
    RetryableError,
    SaveError,
    SaveInProgressError,
    ShardUnavailableError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    TargetMismatchError,
    UnsupportedLeafError,
)
from mtc.options import Options

if TYPE_CHECKING:
    from mtc.manager import CheckpointManager

__version__ = "0.1.0"

__all__ = [
    "AgreementError", "CheckpointManager", "ClosedError", "ConfigError", "CorruptShardError",
    "DataLossError", "DirectoryLockedError", "FatalError", "InvalidStepError", "LocalDirError",
    "ManifestError", "MixedRunError", "MtcError", "Options", "RamDiskFullError",
    "RetryableError", "SaveError", "SaveInProgressError",
    "ShardUnavailableError", "StepExistsError", "StepNotFoundError", "StorageError",
    "TargetMismatchError", "UnsupportedLeafError", "__version__",
]


def __getattr__(name: str) -> Any:
    # The manager pulls in JAX; processes that only need the on-disk format and
    # errors (the replicator) start faster without it.
    if name == "CheckpointManager":
        from mtc.manager import CheckpointManager
        return CheckpointManager
    raise AttributeError(f"module 'mtc' has no attribute {name!r}")
