"""User-facing options of :class:`mtc.CheckpointManager`."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from mtc.errors import ConfigError

BusyPolicy = Literal["wait", "skip"]
LossPolicy = Literal["raise", "start_over"]
Dispatch = Literal["auto", "local", "colocated", "process"]


@dataclasses.dataclass(frozen=True)
class Options:
    """How and when the manager saves.

    Attributes:
      save_interval_steps: ``save(step, ...)`` writes only when ``step`` is a
        multiple of this (or ``force=True``); ``0``: at no interval (Orbax sets
        it so on a read-only manager). Beside ``save_decision_policy`` it is
        ignored (logged), as Orbax's.
      save_on_steps: steps ``save`` also writes, besides the interval (Orbax's).
      should_save_fn: Orbax's ``should_save_fn(step, latest_step) -> bool``: when
        given, it alone decides (with the preemption sync point), replacing
        ``save_interval_steps``, ``save_on_steps`` and the job's first save.
      enable_async_checkpointing: ``False``: ``save`` returns once the step is
        committed on every host (Orbax's synchronous saves); ``True`` (the
        default) writes in the background.
      max_to_keep: committed steps kept on the local tier; older ones are deleted
        after each commit, and before a new step is written the oldest beyond
        ``max_to_keep - 1`` goes (never the newest complete step), so the RAM
        disk holds at most ``max(max_to_keep, 2)`` steps at any moment.
        ``0`` (Orbax's "keep none" beside ``keep_period``/``keep_time_interval``):
        only those and the newest complete step, which mtc never deletes (the
        step a restore after a failure needs).
        ``None`` (the default, as Orbax's) keeps every step the RAM disk can hold:
        a save that does not fit fails with :class:`mtc.RamDiskFullError`. With
        replicators, retention is theirs either way.
      keep_period: steps that are multiples of this are never deleted by
        retention (Orbax's ``keep_period``); they add to the RAM disk's size.
      keep_time_interval: Orbax's: a step saved at least this long (a
        ``datetime.timedelta`` or seconds) after the last one kept so is never
        deleted by retention; a step's time is when its save began, on Orbax's
        clock (``datetime.datetime.now``), kept in its manifest so that a restarted
        job goes on from it (a step of unknown time is kept). Without replicators
        only.
      best_fn: keep steps by quality rather than recency (Orbax's ``best_fn``):
        a function of a step's ``metrics`` (as ``save(..., metrics=)`` gave them)
        returning a number; with ``max_to_keep`` the best ``max_to_keep`` complete
        steps stay (and multiples of ``keep_period``). ``best_step()`` names the
        best. Without replicators only.
      best_mode: ``"max"`` (higher ``best_fn`` is better) or ``"min"``.
      keep_checkpoints_without_metrics: with ``best_fn``, steps saved without
        metrics are never deleted (Orbax's default); ``False``: they go first.
      if_busy: what ``save`` does when the staging budget is used by saves still
        being written: ``"wait"`` blocks until enough memory is free, ``"skip"``
        returns ``False`` without saving.
      max_staged_bytes: bound on host memory holding staged shards not yet
        written. ``None`` means twice the bytes of the first saved state, so one
        save can be staged while the previous one is written.
      writer_threads: threads per process writing and checksumming shard files.
      save_device_copy_bytes: on an accelerator, ``save`` first copies the state
        within device memory (milliseconds) and the device-to-host transfer reads
        that copy while the next steps run, so a step that donates the state
        never waits for the transfer. This bounds the copy, per device, in
        bytes. ``None``: the device memory the job has never used at its peak
        (buffers and what the platform reserved for programs; less 2%, and less
        the process's other copies still alive); ``0``: never
        copy (``save`` blocks for the transfer, as it also does, said once, for
        the part of a state that does not fit). CPU devices copy nothing.
      dispatch: how host-side code is invoked. ``"local"`` calls it in this
        process (multi-controller JAX, simulated hosts); ``"colocated"`` goes
        through ``jax.experimental.colocated_python`` (Pathways);
        ``"process"`` sends every host operation to a sidecar process per host
        (``sidecars``; the local cluster); ``"colocated"`` with ``sidecars``
        runs the colocated-Python programs in those sidecars, as Pathways
        workers would (the local cluster's hosts started with
        ``--colocated-devices``); ``"auto"`` picks colocated on Pathways and
        with ``sidecars`` that all run colocated Python, process with other
        sidecars, local elsewhere (the manager's ``dispatch_mode`` says which).
      hosts_per_slice: hosts per slice when devices carry no ``slice_index``.
      simulated_hosts: group this process's devices into this many simulated
        hosts (one RAM-disk root each, under ``<local_dir>/host-<i>/``). ``None``
        means one host per JAX process.
      host_subdirs: keep each host's steps under ``<local_dir>/host-<i>/``
        rather than in ``local_dir`` itself. ``None``: off with one process per
        host (multi-controller JAX: ``local_dir`` is the host's RAM disk, where
        its replicator looks) and on Pathways; on for a single process on CPU
        devices (this machine standing in for a job's hosts). Processes of one
        machine sharing a ``local_dir`` set it on (else the second one gets
        ``DirectoryLockedError``). With replicators, a manager whose host root is
        not its replicator's ``--local-dir`` fails at start with ``ConfigError``.
      replicators: each host's ``mtc-replicator`` address, in host order. With
        replicators, ``restore()`` without a step asks them to agree on the
        newest step restorable on every host and to fetch missing data from
        peers first; retention is then theirs (``max_to_keep`` is applied only
        to a host whose replicator does not answer, until it does).
        In multi-controller JAX with a RAM disk per process (no host subfolders)
        they also serve the manifests and regions this process's host does not
        hold (a restore onto another mesh or onto fewer processes).
      replicator_ranks: each host's rank among the replicators (their ``--rank``),
        in host order; ``None``: host ``h`` is rank ``h``. These ranks are the job's
        membership in the replicators' restore agreement: a job that comes back on
        fewer hosts than saved (4 processes as 2) agrees among its own hosts, and
        the data of the hosts gone must be held by them (peer copies) or backed
        up. State the ranks when the job's hosts are not the first ones: its
        manifests then name them, so its own steps restore later on these
        hosts or on all of them again.
      replicator_token: the replicators' shared token, if they require one; also
        presented to the hosts' ``sidecars``, which take the same credentials.
      replicator_tls: ``(certificate, key, CA)`` PEM files for mutual TLS with the
        replicators (their ``--tls-cert/--tls-key/--tls-ca``; on Kubernetes the
        pod's own certificate, ``tls.crt``, ``tls.key``, ``ca.crt`` of the volume
        cert-manager's CSI driver mounts) and the sidecars. A Pathways controller's
        certificate names no rank; a multi-controller trainer's is its pod's,
        naming that host's rank (docs/security.md).
      replicator_pod_names: ``(pod prefix, hosts per slice)``: with
        ``replicator_tls`` on Kubernetes, how the job's worker pods are named, so
        that this process reads a certificate naming pod
        ``<prefix><slice>-<host>-xxxxx`` as rank ``slice * hosts + host``, as the
        replicators do (their ``--tls-pod-prefix``, ``--tls-hosts-per-slice``; in a
        JobSet ``mtc.jobset.JobSetPlace.from_env().pod_names``). A multi-controller
        process then reads another replicator's copy of a rank's data only when it
        is proven that rank's, as the replicators do. Process-wide: every manager
        of a process reads pod names one way.
      restore_timeout_s: how long a restore waits for the replicators (a member
        that does not ask fails their agreement sooner, at their
        ``--agreement-timeout-seconds``; this bound holds for this process's own
        replicator not answering, and for the data made local).
      restore_while_fetching: with replicators and one controller planning
        every host's reads: a host that holds no copy of the agreed step (a
        replaced host) does not hold the restore up while its replicator fetches
        its data from a peer; its devices' regions are read from the other
        hosts' copies of the same regions (data-parallel replicas over slices)
        and its replicator makes its data local in the background (until it
        is, that host's data of the step is on its peers only). Where no other
        copy covers a region, the restore waits for that data. ``False``: every
        host's data is local before anything is read.
      sidecars: each host's sidecar process address (``python -m
        mtc.sidecar.host.main``), in host order; with them the hosts' RAM disks are
        reached only through those processes, never from this one.
      read_only: the manager only reads (Orbax's ``read_only``): it takes no
        writer lock, so it may open a directory another manager writes to; it
        removes nothing; ``save`` returns False and ``delete`` does nothing, each
        with a warning, as Orbax's.
      save_root_metadata: Orbax's: ``False`` keeps no root metadata (the
        manager's ``metadata=`` is neither kept nor answered); ``metadata()``
        answers one an earlier manager kept, else ``{}``.
      preservation_policy: Orbax's retention object instead of ``max_to_keep``,
        ``keep_period`` and ``best_fn`` (``LatestN``, ``EveryNSteps``,
        ``EveryNStepsClosest``, ``EveryNSeconds``, ``LatestDuration``,
        ``CustomSteps``, ``BestN``, ``PreserveAll``, ``AnyPreservationPolicy`` of
        ``orbax.checkpoint.checkpoint_managers``), read as :mod:`mtc.policies`
        says: the complete steps it does not keep are deleted, never the newest
        one. A step's time is known for the steps this manager saved; a step of
        unknown time is kept. Without replicators only.
      save_decision_policy: Orbax's save schedule object instead of
        ``save_interval_steps`` (``FixedIntervalPolicy``, ``SpecificStepsPolicy``,
        ``ContinuousCheckpointingPolicy``, ``PreemptionCheckpointingPolicy``,
        ``InitialSavePolicy``, ``AnySavePolicy``): ``save`` writes a step newer
        than the newest when it says so. ``ContinuousCheckpointingPolicy`` saves
        whenever no save is being written (and its ``minimum_interval_secs``
        since the newest step's save began passed: after a restart, the time its
        manifest records). In multi-controller JAX process
        0's decision is every process's.
      if_data_lost: what ``latest_step``/``restore`` do when no step can be
        restored although some hosts still hold steps (another host's data of
        every step is gone: its RAM disk, its peers' copies, the backup).
        ``"raise"``: :class:`mtc.DataLossError` naming the steps and hosts (bring
        the data back, e.g. a backup, and restart); ``"start_over"``: answer
        ``None`` and delete the unrestorable steps on this job's hosts, so the
        job starts from scratch and saves those step numbers again.
    """

    save_interval_steps: int = 1
    save_on_steps: frozenset[int] | None = None
    should_save_fn: Callable[[int, int | None], bool] | None = None
    enable_async_checkpointing: bool = True
    max_to_keep: int | None = None
    keep_period: int | None = None
    keep_time_interval: datetime.timedelta | float | None = None
    best_fn: Callable[[Any], float] | None = None
    best_mode: Literal["max", "min"] = "max"
    keep_checkpoints_without_metrics: bool = True
    if_busy: BusyPolicy = "wait"
    max_staged_bytes: int | None = None
    writer_threads: int = 2
    save_device_copy_bytes: int | None = None
    dispatch: Dispatch = "auto"
    hosts_per_slice: int = 1
    simulated_hosts: int | None = None
    host_subdirs: bool | None = None
    replicators: tuple[str, ...] | None = None
    replicator_ranks: tuple[int, ...] | None = None
    replicator_token: str | None = None
    replicator_tls: tuple[str, str, str] | None = None
    replicator_pod_names: tuple[str, int] | None = None
    restore_timeout_s: float = 120.0
    restore_while_fetching: bool = True
    sidecars: tuple[str, ...] | None = None
    read_only: bool = False
    if_data_lost: LossPolicy = "raise"
    preservation_policy: Any = None
    save_decision_policy: Any = None
    save_root_metadata: bool = True  # last: the fields' positions stay

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want_int = f.type in ("int", "int | None")
            if want_int and v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ConfigError(f"{f.name} must be an integer, got {type(v).__name__} {v!r}")
        if self.save_interval_steps < 0:
            raise ConfigError(f"save_interval_steps must be >= 0, got {self.save_interval_steps}")
        if self.save_on_steps is not None:
            steps = self.save_on_steps
            if isinstance(steps, (str, bytes)) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in steps):
                raise ConfigError(f"save_on_steps are step numbers (ints >= 0), got {steps!r}")
            object.__setattr__(self, "save_on_steps", frozenset(steps))
        if self.should_save_fn is not None and not callable(self.should_save_fn):
            raise ConfigError("should_save_fn is a function (step, latest_step) -> bool, got "
                              f"{type(self.should_save_fn).__name__}")
        if self.max_to_keep is not None and self.max_to_keep < 0:
            raise ConfigError(f"max_to_keep must be >= 0 or None, got {self.max_to_keep}")
        if self.keep_period is not None and self.keep_period < 1:
            raise ConfigError(f"keep_period must be >= 1 or None, got {self.keep_period}")
        if self.keep_time_interval is not None:
            t = self.keep_time_interval
            secs = t.total_seconds() if isinstance(t, datetime.timedelta) else t
            if not isinstance(secs, (int, float)) or isinstance(secs, bool) or secs <= 0:
                raise ConfigError("keep_time_interval is a positive datetime.timedelta or "
                                  f"seconds, got {t!r}")
            if self.replicators:
                raise ConfigError("keep_time_interval keeps steps on the RAM disk; with "
                                  "replicators retention is theirs (--keep): leave it out, "
                                  "or the replicators")
        if self.best_fn is not None and not callable(self.best_fn):
            raise ConfigError(f"best_fn is a function of a step's metrics, got "
                              f"{type(self.best_fn).__name__}")
        if self.best_mode not in ("max", "min"):
            raise ConfigError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")
        if self.best_fn is not None and self.replicators:
            raise ConfigError("best_fn keeps steps by metrics on the RAM disk; with replicators "
                              "retention is theirs (by recency): leave best_fn out, or the "
                              "replicators")
        self._check_policies()
        if self.if_busy not in ("wait", "skip"):
            raise ConfigError(f"if_busy must be 'wait' or 'skip', got {self.if_busy!r}")
        if self.max_staged_bytes is not None and self.max_staged_bytes <= 0:
            raise ConfigError(f"max_staged_bytes must be positive, got {self.max_staged_bytes}")
        if self.save_device_copy_bytes is not None and self.save_device_copy_bytes < 0:
            raise ConfigError(f"save_device_copy_bytes must be >= 0 or None, got "
                              f"{self.save_device_copy_bytes}")
        if self.writer_threads < 1:
            raise ConfigError(f"writer_threads must be >= 1, got {self.writer_threads}")
        if self.if_data_lost not in ("raise", "start_over"):
            raise ConfigError(f"if_data_lost must be 'raise' or 'start_over', got "
                              f"{self.if_data_lost!r}")
        if self.dispatch not in ("auto", "local", "colocated", "process"):
            raise ConfigError("dispatch must be auto, local, colocated or process, "
                              f"got {self.dispatch!r}")
        if self.dispatch == "process" and not self.sidecars:
            raise ConfigError("dispatch='process' goes with sidecars=(one address per host)")
        if self.dispatch == "local" and self.sidecars:
            raise ConfigError("dispatch='local' runs host-side code here: no sidecars")
        if self.hosts_per_slice < 1:
            raise ConfigError(f"hosts_per_slice must be >= 1, got {self.hosts_per_slice}")
        if self.simulated_hosts is not None and self.simulated_hosts < 1:
            raise ConfigError(f"simulated_hosts must be >= 1, got {self.simulated_hosts}")
        if self.replicator_ranks is not None and (
                len(set(self.replicator_ranks)) != len(self.replicator_ranks)
                or any(not isinstance(r, int) or r < 0 for r in self.replicator_ranks)):
            raise ConfigError("replicator_ranks are distinct ranks >= 0, got "
                              f"{self.replicator_ranks!r}")
        if self.replicator_tls is not None and (
                len(self.replicator_tls) != 3 or not all(self.replicator_tls)):
            raise ConfigError("replicator_tls is (certificate, key, CA) files, got "
                              f"{self.replicator_tls!r}")
        if self.replicator_pod_names is not None:
            self._check_pod_names()

    def _check_pod_names(self) -> None:
        from mtc.rank_names import PodNames

        names = self.replicator_pod_names
        if not (isinstance(names, tuple) and len(names) == 2 and isinstance(names[0], str)
                and isinstance(names[1], int) and not isinstance(names[1], bool)):
            raise ConfigError("replicator_pod_names is (pod prefix, hosts per slice), got "
                              f"{names!r}")
        PodNames(*names)  # ConfigError when no JobSet names its pods so
        if self.replicator_tls is None:
            raise ConfigError("replicator_pod_names says how certificates name ranks: it goes "
                              "with replicator_tls")

    def _check_policies(self) -> None:
        """Orbax's policy objects: ones mtc reads, not beside the options they replace."""
        from mtc import policies

        if self.preservation_policy is not None:
            policies.check(self.preservation_policy, policies.PRESERVATION,
                           "preservation_policy")
            beside = [n for n in ("max_to_keep", "keep_period", "keep_time_interval", "best_fn")
                      if getattr(self, n) is not None]
            if beside:
                raise ConfigError(f"preservation_policy replaces {', '.join(beside)}: give "
                                  f"one or the other")
            if self.replicators:
                raise ConfigError("preservation_policy keeps steps on the RAM disk; with "
                                  "replicators retention is theirs (--keep): leave it out, "
                                  "or the replicators")
        if self.save_decision_policy is not None:
            policies.check(self.save_decision_policy, policies.SAVE_DECISION,
                           "save_decision_policy")
            if self.save_interval_steps != 1:
                # Orbax ignores the interval beside a policy; a user switching keeps both.
                logging.getLogger("mtc.manager").warning(
                    "mtc: save_decision_policy replaces save_interval_steps=%d: the interval "
                    "is ignored (FixedIntervalPolicy(n) is the interval)",
                    self.save_interval_steps)


# Orbax's ``CheckpointManagerOptions`` fields mtc has no field of the same name for,
# and what to use instead: an Orbax user who passes one gets a ConfigError that
# says so (never a TypeError from the dataclass).
_ORBAX_ONLY = {
    "step_prefix": "nothing: mtc names a step folder by its number",
    "step_format_fixed_length": "nothing: mtc names a step folder by its number",
    "step_name_format": "nothing: mtc names a step folder by its number",
    "create": "nothing: mtc creates local_dir",
    "cleanup_tmp_directories": "nothing: mtc always removes its own uncommitted folders",
    "async_options": "nothing: mtc saves in the background always",
    "multiprocessing_options": "nothing: every process of the job calls the manager",
    "enable_background_delete": "nothing: mtc deletes in the background always",
    "todelete_subdir": "nothing: mtc deletes what retention drops",
    "todelete_full_path": "nothing: mtc deletes what retention drops",
    "single_host_load_and_broadcast": "nothing: each host reads its own shards",
    "file_options": "nothing",
    "atomicity_options": "nothing: a step is committed by one rename",
    "temporary_path_class": "nothing: a step is committed by one rename",
    "prevent_write_metrics": "save(step, state) without metrics=",
    "enable_should_save_is_saving_in_progress_check": "nothing",
    "enable_per_process_directory_creation": "host_subdirs",
    "lightweight_initialize": "nothing",
    "num_deletion_threads": "nothing",
}

_dataclass_init = Options.__init__


@functools.wraps(_dataclass_init)
def _init(self: Options, *args: Any, **kwargs: Any) -> None:
    known = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        hints = "; ".join(f"{k}: use {_ORBAX_ONLY[k]}" if k in _ORBAX_ONLY
                          else f"{k}: no such option" for k in unknown)
        raise ConfigError(f"mtc.Options has no {', '.join(unknown)} ({hints}); "
                          f"its fields: {', '.join(sorted(known))}")
    if len(args) > len(known):
        raise ConfigError(f"mtc.Options takes at most {len(known)} arguments")
    _dataclass_init(self, *args, **kwargs)


setattr(Options, "__init__", _init)  # noqa: B010 (the dataclass's own __init__, wrapped)

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_dir_path(local_dir: Any) -> Path:
    """``local_dir`` as the manager uses it: an absolute local path, as given.

    A URL is refused (a bucket is the backup tier, the replicators'), and so are
    a relative path and one starting with ``~``: the folder is named on every
    host, where this process's working directory and home mean nothing, and an
    Orbax user's ``gs://`` or ``~/ckpt`` must not become a folder of that name
    here."""
    try:
        raw = os.fspath(local_dir)
    except TypeError:
        raise ConfigError(f"local_dir is a path, got {type(local_dir).__name__}") from None
    if isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    if _SCHEME.match(raw):
        raise ConfigError(
            f"local_dir must be a local absolute path (the hosts' RAM disk, e.g. "
            f"/dev/shm/mtc), got the URL {raw!r}. A bucket is mtc's backup tier: give it to "
            f"each host's replicator, e.g. `mtc-replicator --local-dir /dev/shm/mtc "
            f"--backup {raw} ...`, and Options(replicators=...) to the manager "
            f"(README: The peer and backup tiers)")
    if not raw:
        raise ConfigError("local_dir is empty: give the hosts' RAM disk, e.g. /dev/shm/mtc")
    if raw.startswith("~"):
        raise ConfigError(
            f"local_dir {raw!r} starts with '~', which mtc does not expand: the folder is "
            f"named on every host, whose home is not this process's. Give an absolute path "
            f"(e.g. /dev/shm/mtc), or os.path.expanduser({raw!r}) when the hosts are this "
            f"machine")
    if not os.path.isabs(raw):
        raise ConfigError(
            f"local_dir must be an absolute path, got {raw!r} (a relative path names a "
            f"different folder on each host's working directory); e.g. "
            f"os.path.abspath({raw!r}) if this machine's folder is meant")
    return Path(raw)
