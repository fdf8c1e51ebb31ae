from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FileInfo(_message.Message):
    __slots__ = ("path", "size", "crc32c", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    crc32c: int
    sha256: bytes
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., crc32c: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class CopyProof(_message.Message):
    __slots__ = ("digest", "signature", "chain")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    digest: bytes
    signature: bytes
    chain: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, digest: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., chain: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StepCopy(_message.Message):
    __slots__ = ("step", "origin_rank", "files", "saved_hosts", "run", "fingerprint", "saving_ranks", "proof")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_RANK_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    SAVED_HOSTS_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SAVING_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    step: int
    origin_rank: int
    files: _containers.RepeatedCompositeFieldContainer[FileInfo]
    saved_hosts: int
    run: str
    fingerprint: int
    saving_ranks: _containers.RepeatedScalarFieldContainer[int]
    proof: CopyProof
    def __init__(self, step: _Optional[int] = ..., origin_rank: _Optional[int] = ..., files: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ..., saved_hosts: _Optional[int] = ..., run: _Optional[str] = ..., fingerprint: _Optional[int] = ..., saving_ranks: _Optional[_Iterable[int]] = ..., proof: _Optional[_Union[CopyProof, _Mapping]] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("rank_only", "origins", "without_files", "identify")
    RANK_ONLY_FIELD_NUMBER: _ClassVar[int]
    ORIGINS_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_FILES_FIELD_NUMBER: _ClassVar[int]
    IDENTIFY_FIELD_NUMBER: _ClassVar[int]
    rank_only: bool
    origins: _containers.RepeatedScalarFieldContainer[int]
    without_files: bool
    identify: bool
    def __init__(self, rank_only: _Optional[bool] = ..., origins: _Optional[_Iterable[int]] = ..., without_files: _Optional[bool] = ..., identify: _Optional[bool] = ...) -> None: ...

class NodeConfig(_message.Message):
    __slots__ = ("nodes", "nodes_per_slice")
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODES_PER_SLICE_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    nodes_per_slice: int
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., nodes_per_slice: _Optional[int] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("rank", "copies", "newest_backed_up_step", "backed_up_steps", "last_decision", "quarantined_files", "root_id", "config", "config_error", "unreplicated_step", "unreplicated_seconds", "replication_late", "data_port", "damaged", "unanswered_peers")
    RANK_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    NEWEST_BACKED_UP_STEP_FIELD_NUMBER: _ClassVar[int]
    BACKED_UP_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FILES_FIELD_NUMBER: _ClassVar[int]
    ROOT_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CONFIG_ERROR_FIELD_NUMBER: _ClassVar[int]
    UNREPLICATED_STEP_FIELD_NUMBER: _ClassVar[int]
    UNREPLICATED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_LATE_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_PEERS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    copies: _containers.RepeatedCompositeFieldContainer[StepCopy]
    newest_backed_up_step: int
    backed_up_steps: _containers.RepeatedScalarFieldContainer[int]
    last_decision: Decision
    quarantined_files: int
    root_id: str
    config: NodeConfig
    config_error: str
    unreplicated_step: int
    unreplicated_seconds: float
    replication_late: bool
    data_port: int
    damaged: _containers.RepeatedCompositeFieldContainer[StepCopy]
    unanswered_peers: _containers.RepeatedCompositeFieldContainer[PeerFault]
    def __init__(self, rank: _Optional[int] = ..., copies: _Optional[_Iterable[_Union[StepCopy, _Mapping]]] = ..., newest_backed_up_step: _Optional[int] = ..., backed_up_steps: _Optional[_Iterable[int]] = ..., last_decision: _Optional[_Union[Decision, _Mapping]] = ..., quarantined_files: _Optional[int] = ..., root_id: _Optional[str] = ..., config: _Optional[_Union[NodeConfig, _Mapping]] = ..., config_error: _Optional[str] = ..., unreplicated_step: _Optional[int] = ..., unreplicated_seconds: _Optional[float] = ..., replication_late: _Optional[bool] = ..., data_port: _Optional[int] = ..., damaged: _Optional[_Iterable[_Union[StepCopy, _Mapping]]] = ..., unanswered_peers: _Optional[_Iterable[_Union[PeerFault, _Mapping]]] = ...) -> None: ...

class PeerFault(_message.Message):
    __slots__ = ("rank", "address", "seconds", "error", "target")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    seconds: float
    error: str
    target: bool
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ..., target: _Optional[bool] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("epoch", "step", "decided_at", "rank", "restore_id", "run", "lost")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESTORE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    decided_at: float
    rank: int
    restore_id: str
    run: str
    lost: str
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., decided_at: _Optional[float] = ..., rank: _Optional[int] = ..., restore_id: _Optional[str] = ..., run: _Optional[str] = ..., lost: _Optional[str] = ...) -> None: ...

class OfferRequest(_message.Message):
    __slots__ = ("copy",)
    COPY_FIELD_NUMBER: _ClassVar[int]
    copy: StepCopy
    def __init__(self, copy: _Optional[_Union[StepCopy, _Mapping]] = ...) -> None: ...

class OfferReply(_message.Message):
    __slots__ = ("candidates", "already_complete", "transfer_id", "data_port")
    class Candidate(_message.Message):
        __slots__ = ("path", "sha256")
        PATH_FIELD_NUMBER: _ClassVar[int]
        SHA256_FIELD_NUMBER: _ClassVar[int]
        path: str
        sha256: bytes
        def __init__(self, path: _Optional[str] = ..., sha256: _Optional[bytes] = ...) -> None: ...
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    ALREADY_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[OfferReply.Candidate]
    already_complete: bool
    transfer_id: str
    data_port: int
    def __init__(self, candidates: _Optional[_Iterable[_Union[OfferReply.Candidate, _Mapping]]] = ..., already_complete: _Optional[bool] = ..., transfer_id: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("transfer_id", "paths")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transfer_id: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ...) -> None: ...

class LinkReply(_message.Message):
    __slots__ = ("linked",)
    LINKED_FIELD_NUMBER: _ClassVar[int]
    linked: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, linked: _Optional[_Iterable[str]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("step", "origin_rank")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_RANK_FIELD_NUMBER: _ClassVar[int]
    step: int
    origin_rank: int
    def __init__(self, step: _Optional[int] = ..., origin_rank: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecideRequest(_message.Message):
    __slots__ = ("rank", "restore_id", "timeout_seconds", "members", "started_ns")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESTORE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    STARTED_NS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    restore_id: str
    timeout_seconds: float
    members: _containers.RepeatedScalarFieldContainer[int]
    started_ns: int
    def __init__(self, rank: _Optional[int] = ..., restore_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., members: _Optional[_Iterable[int]] = ..., started_ns: _Optional[int] = ...) -> None: ...

class DecideReply(_message.Message):
    __slots__ = ("decision",)
    DECISION_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    def __init__(self, decision: _Optional[_Union[Decision, _Mapping]] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompleteReply(_message.Message):
    __slots__ = ("kept",)
    KEPT_FIELD_NUMBER: _ClassVar[int]
    kept: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kept: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareRestoreRequest(_message.Message):
    __slots__ = ("timeout_seconds", "restore_id", "members", "background")
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    restore_id: str
    members: _containers.RepeatedScalarFieldContainer[int]
    background: bool
    def __init__(self, timeout_seconds: _Optional[float] = ..., restore_id: _Optional[str] = ..., members: _Optional[_Iterable[int]] = ..., background: _Optional[bool] = ...) -> None: ...

class PrepareRestoreReply(_message.Message):
    __slots__ = ("step", "tier", "seconds", "epoch", "pending", "run", "lost")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    step: int
    tier: str
    seconds: float
    epoch: int
    pending: bool
    run: str
    lost: str
    def __init__(self, step: _Optional[int] = ..., tier: _Optional[str] = ..., seconds: _Optional[float] = ..., epoch: _Optional[int] = ..., pending: _Optional[bool] = ..., run: _Optional[str] = ..., lost: _Optional[str] = ...) -> None: ...

class RestoredRequest(_message.Message):
    __slots__ = ("restore_id", "step")
    RESTORE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    restore_id: str
    step: int
    def __init__(self, restore_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class RestoredReply(_message.Message):
    __slots__ = ("fetching",)
    FETCHING_FIELD_NUMBER: _ClassVar[int]
    fetching: bool
    def __init__(self, fetching: _Optional[bool] = ...) -> None: ...

class BackupRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class BackupReply(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class BackupPartRequest(_message.Message):
    __slots__ = ("step", "origin_rank", "prefix", "upload", "hash")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_RANK_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    step: int
    origin_rank: int
    prefix: str
    upload: _containers.RepeatedScalarFieldContainer[str]
    hash: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., origin_rank: _Optional[int] = ..., prefix: _Optional[str] = ..., upload: _Optional[_Iterable[str]] = ..., hash: _Optional[_Iterable[str]] = ...) -> None: ...

class BackupPartReply(_message.Message):
    __slots__ = ("entries",)
    class Entry(_message.Message):
        __slots__ = ("path", "sha256", "uploaded")
        PATH_FIELD_NUMBER: _ClassVar[int]
        SHA256_FIELD_NUMBER: _ClassVar[int]
        UPLOADED_FIELD_NUMBER: _ClassVar[int]
        path: str
        sha256: bytes
        uploaded: bool
        def __init__(self, path: _Optional[str] = ..., sha256: _Optional[bytes] = ..., uploaded: _Optional[bool] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[BackupPartReply.Entry]
    def __init__(self, entries: _Optional[_Iterable[_Union[BackupPartReply.Entry, _Mapping]]] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("path", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("step", "origin_rank", "path", "offset", "more_paths", "reread")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_RANK_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MORE_PATHS_FIELD_NUMBER: _ClassVar[int]
    REREAD_FIELD_NUMBER: _ClassVar[int]
    step: int
    origin_rank: int
    path: str
    offset: int
    more_paths: _containers.RepeatedScalarFieldContainer[str]
    reread: bool
    def __init__(self, step: _Optional[int] = ..., origin_rank: _Optional[int] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., more_paths: _Optional[_Iterable[str]] = ..., reread: _Optional[bool] = ...) -> None: ...

class DataRequest(_message.Message):
    __slots__ = ("token", "transfer_id", "files", "fetch")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    token: str
    transfer_id: str
    files: _containers.RepeatedScalarFieldContainer[int]
    fetch: FetchRequest
    def __init__(self, token: _Optional[str] = ..., transfer_id: _Optional[str] = ..., files: _Optional[_Iterable[int]] = ..., fetch: _Optional[_Union[FetchRequest, _Mapping]] = ...) -> None: ...

class DataStatus(_message.Message):
    __slots__ = ("code", "message", "step", "host", "path", "size")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    step: int
    host: int
    path: str
    size: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., step: _Optional[int] = ..., host: _Optional[int] = ..., path: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...
