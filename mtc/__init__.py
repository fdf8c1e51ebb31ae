"""mtc: multi-tier checkpointing for JAX (RAM disk, peer host, cloud storage)."""

from mtc.errors import (
                        ConfigError,
                        CorruptShardError,
                        FatalError,
                        ManifestError,
                        MtcError,
                        RamDiskFullError,
                        RetryableError,
                        SaveInProgressError,
                        ShardUnavailableError,
                        StepExistsError,
                        StepNotFoundError,
                        StorageError,
                        TargetMismatchError,
                        UnsupportedLeafError,
)
from mtc.manager import CheckpointManager
from mtc.options import Options

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager", "ConfigError", "CorruptShardError", "FatalError", "ManifestError",
    "MtcError", "Options", "RamDiskFullError", "RetryableError", "SaveInProgressError",
    "ShardUnavailableError", "StepExistsError", "StepNotFoundError", "StorageError",
    "TargetMismatchError", "UnsupportedLeafError", "__version__",
]
