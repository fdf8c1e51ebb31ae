"""Making this host's data of an agreed step local (the restore's placing half;
``restore.py`` asks and schedules): a local copy checked file by file and healed
in place, or the step fetched from the hosts that hold copies of it (a few
streams, then file by file), else from the backup, every byte verified on
arrival and proven its origin's before the step is placed."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from mtc.errors import CorruptShardError, MtcError, StepNotFoundError
from mtc.pool import ThreadPool
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.agree.node_agreement import holders_of
from mtc.sidecar.replicator.copies.provenance import not_signed, own_signed
from mtc.sidecar.replicator.fetch.fetch_plan import fetch_batches, fetch_order, heal_sources
from mtc.sidecar.replicator.store.step_files import FileMeta, inside
from mtc.sidecar.storage.checksum import copy_verified, file_sha256
from mtc.sidecar.storage.names import tmp_dir

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from concurrent.futures import Executor

    from mtc.sidecar.backup.duties import BackupDuties
    from mtc.sidecar.replicator.config import ReplicatorConfig
    from mtc.sidecar.replicator.copies.provenance import ProofCheck
    from mtc.sidecar.replicator.metrics import Metrics
    from mtc.sidecar.replicator.store.store import LocalStore
    from mtc.sidecar.replicator.transport import Opener, Peer
    from mtc.sidecar.storage.reserve import Reserve

log = logging.getLogger(__name__)
FETCH_STREAMS = 4  # a restore's streams from one holder: the fetch pool's threads


class Materializer:
    """Brings this host's data of a step, verified, into its store. It owns the
    fetch pool (``FETCH_STREAMS`` threads); a caller may fetch on a pool of its own
    (the restore's background). ``agreement``: its proof checks, when copies are
    proven their origin's."""

    def __init__(self, config: ReplicatorConfig, store: LocalStore,
                 peers: Mapping[int, Peer], metrics: Metrics, *,
                 proofs: ProofCheck | None, backups: BackupDuties,
                 reserve: Reserve) -> None:
        self.rank = config.rank
        # Blank files set aside for this host's own data (a replaced host's fetch:
        # ReplicationLoop.set_aside_for_restore); fetched files take their places.
        self._reserve = reserve
        self.config = config
        self.store = store
        self.peers = peers
        self.metrics = metrics
        # With mutual TLS, what proves fetched bytes their origin's; None without.
        self.proofs = proofs
        self.backups = backups
        self.backup = backups.backup
        self._pool = ThreadPool(FETCH_STREAMS, "mtc-fetch", lazy=True)

    def close(self) -> None:
        """After the background restore: the fetch pool."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def holds_own(self, step: int, run: str) -> bool:
        """Whether this host holds its own data of ``step`` as ``run`` wrote it
        (damaged files included: they are healed in place)."""
        if (self.rank, step) not in self.store.copies() and \
                not self.store.damaged(self.rank, step):
            return False
        try:
            return not run or self.store.summary(self.rank, step)[1] == run
        except OSError:
            return False


    def materialize(self, step: int, invs: dict[int, pb.Inventory], *, into_root: bool,
                    run: str = "", pool: Executor | None = None) -> str:
        """Make this host's data of ``step`` (as ``run`` wrote it; "": whatever run)
        local and verified; returns the tier it came from ("local", "peer" or
        "backup"). A copy held here of another run under the same number is another
        checkpoint: it is removed and this run's fetched.

        A local copy is checked file by file first (for Orbax clients every byte is
        read again: their reader checks nothing); a file that fails is quarantined
        and fetched again, verified, from another holder: the copies of this rank's
        data, then an identical file of another data-parallel replica, then the
        backup. No good copy anywhere: CorruptShardError naming the file. ``pool``:
        the threads that fetch (default: the restore's own)."""
        if not self.holds_own(step, run) and (self.store.copy_dir(self.rank, step).exists()):
            log.warning("rank %d: its copy of step %d was written by another run than the "
                        "agreed one (%s): replaced", self.rank, step, run)
            self.store.remove_copy(self.rank, step)
        if self.holds_own(step, run):
            bad = self.store.verify(self.rank, step, cached=self.config.framework == "mtc")
            if not bad:
                return "local"
            log.warning("rank %d: step %d has %d bad files (%s, ...); healing", self.rank,
                        step, len(bad), bad[0].path)
            tmp = self.store.begin_incoming(self.rank, step)
            try:
                signed, invs = self._heal_proof(step, invs, run)
                tiers = self._fetch_all(step, self.rank, invs, bad, tmp, run, pool,
                                        want=signed)
                forged = not_signed(tmp, pb.StepCopy(files=[
                    pb.FileInfo(path=f.path, sha256=signed[f.path]) for f in bad]),
                    (pool or self._pool).map) if signed is not None else None
                if forged is not None:
                    self.metrics.unproven.inc()
                    raise CorruptShardError(f"healing bytes are not the ones rank {self.rank} "
                                            "signed", step=step, host=self.rank, path=forged)
                self.store.repair(self.rank, step, {f.path: tmp / f.path for f in bad})
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self.metrics.healed.inc(len(bad))
            return "backup" if "backup" in tiers else "peer"
        sources = self.copies_elsewhere(step, invs, run)
        tmp = (tmp_dir(self.store.root, step) if into_root
               else self.store.begin_incoming(self.rank, step))
        try:
            if sources:
                files = [FileMeta(f.path, f.size, f.crc32c) for f in sources[0][1].files]
                # Under mutual TLS each file must hash as its origin signed it: one that
                # does not is a bad copy like any other, fetched again from the next
                # holder, then the backup.
                want = ({f.path: bytes(f.sha256) for f in sources[0][1].files if f.sha256}
                        if self.proofs is not None else None)
                tiers = self._fetch_all(step, sources[0][1].origin_rank, invs, files, tmp,
                                        run, pool, want=want)
                # Its origin's signed SHA-256s, before the step is placed (provenance).
                forged = (not_signed(tmp, sources[0][1], (pool or self._pool).map)
                          if self.proofs is not None else None)
                if forged is not None:
                    self.metrics.unproven.inc()
                    raise CorruptShardError(f"fetched bytes are not the ones rank "
                                            f"{sources[0][1].origin_rank} signed", step=step,
                                            host=self.rank, path=forged)
                tier = "backup" if "backup" in tiers else "peer"
            elif self.backup is not None and step in self.backup.refresh():
                files = self.backups.from_backup(step, invs, tmp)
                tier = "backup"
            else:
                raise StepNotFoundError("no peer or backup holds this host's data", step=step,
                                        host=self.rank)
            self.store.commit_restored(tmp, step, files, into_root=into_root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            # Served from the committed copy from here on (from_backup staged it).
            self.backups.done_restoring(step)
            self._reserve.forget(self.rank)  # what was set aside for it and not used
        return tier

    def _heal_proof(self, step: int, invs: dict[int, pb.Inventory], run: str
                    ) -> tuple[dict[str, bytes] | None, dict[int, pb.Inventory]]:
        """What healing own ``step`` must check, and where from. With mutual TLS a
        healed file must hash as this rank signed it (another rank's identical file,
        or a holder's copy, proves only its CRC32C, which a forger matches at will):
        the SHA-256s come from a proven copy of this rank's data another host lists
        (:func:`own_signed`). With none listed (the step never replicated, its
        holders gone) nothing can prove another host's bytes: only the backup
        heals. Without TLS: nothing is signed, every copy counts (None, ``invs``)."""
        if self.proofs is None:
            return None, invs
        files = self.store.describe(self.rank, step)
        proofs = self.proofs
        signed = own_signed(self.rank, step, files, invs, run,
                            proven=lambda c: proofs.why_not(c) is None)
        if signed is not None:
            return signed, invs
        log.warning("rank %d: no host lists a proven copy of its step %d: its damaged "
                    "files heal from the backup only", self.rank, step)
        return None, {}

    def copies_elsewhere(self, step: int, invs: dict[int, pb.Inventory], run: str = ""
                          ) -> list[tuple[int, pb.StepCopy]]:
        """Other hosts' copies this host's data of ``step`` (of ``run``) can come
        from: of its own data first, else of the first equivalent rank's that has
        some."""
        held = holders_of(invs, run or None)
        for origin in self.config.equivalent(self.rank):
            # A listing without files (its proof may be genuine: the signed statement
            # names the files' digest, not the files) brings nothing: not a source.
            sources = [(h, c) for h, c in held.get((origin, step), [])
                       if h != self.rank and c.files]
            if sources:
                return sources
        return []

    def _fetch_all(self, step: int, origin: int, invs: dict[int, pb.Inventory],
                   files: list[FileMeta], tmp: Path, run: str = "",
                   pool: Executor | None = None,
                   want: Mapping[str, bytes] | None = None) -> set[str]:
        """Fetch ``files`` (of ``origin``'s copy of ``step``, this rank's data or a
        stand-in for it, of ``run``) into ``tmp`` on ``pool``'s threads (default:
        the restore's); returns the tiers used. ``want``: the SHA-256 each file must
        have (its origin signed it): a file fetched otherwise is a bad copy, and
        the next source is tried."""
        pool = pool or self._pool
        sources = heal_sources(self.rank, step, origin, files, invs, run)
        orders = [fetch_order(self.rank, *sources.get(f.path, ([], [])), i)
                  for i, f in enumerate(files)]
        # The files whose first source is another host come in a few streams (a call
        # per file costs more than its bytes); what a stream did not bring, verified,
        # is fetched file by file from every source, as before.
        batches = fetch_batches([o[0] if o else None for o in orders], self.rank,
                                FETCH_STREAMS)
        futs = {pool.submit(self._fetch_batch, holder, src_origin, step,
                                  [files[k] for k in ks], tmp): ks
                for (holder, src_origin), ks in batches}
        done: set[int] = set()
        for fut, ks in futs.items():
            got = set(fut.result())
            done.update(k for k in ks if files[k].path in got)
        # A file a stream brought that its origin did not sign: fetched again from
        # the other sources (that holder's copy is bad: it is not asked again).
        refused: dict[int, list[str]] = {}
        for (holder, src_origin), ks in batches:
            for k in ks:
                if k in done and self._unsigned(want, files[k], tmp, step, holder):
                    done.discard(k)
                    orders[k] = [o for o in orders[k] if o[0] != holder]
                    refused[k] = [f"rank {holder}: not the bytes rank {src_origin} signed"]
        rest = [pool.submit(self._fetch, orders[k], step, files[k], tmp, want,
                            refused.get(k, []))
                for k in range(len(files)) if k not in done]
        tiers = {fut.result() for fut in rest}
        return tiers | {"peer"} if done else tiers

    def _fetch_batch(self, holder: int, origin: int, step: int, files: list[FileMeta],
                     tmp: Path) -> list[str]:
        """Files of ``origin``'s copy of ``step`` from ``holder`` in one stream; the
        paths that arrived verified."""
        got, err = self.peers[holder].fetch_many(step, origin, files, tmp,
                                                 opener=self._opener())
        sizes = {f.path: f.size for f in files}
        self.metrics.bytes_fetched.inc(sum(sizes[p] for p in got))
        if err is not None:
            self.metrics.failures.labels("fetch").inc()
            log.warning("rank %d: %d of %d files of step %d from rank %d (origin %d) in one "
                        "stream; the rest one by one: %s", self.rank, len(got), len(files),
                        step, holder, origin, err)
        return got

    def _opener(self) -> Opener | None:
        """Fetched files of this host's data into the blank files set aside for it
        (pages the RAM disk allocated ahead, written at the speed of memory)."""
        reserve, key = self._reserve, self.rank
        if not reserve.wants(key):
            return None

        def opener(base: Path, rel: str, size: int) -> int:
            return reserve.open_new(base, rel, size, key)
        return opener

    def _unsigned(self, want: Mapping[str, bytes] | None, f: FileMeta, tmp: Path, step: int,
                  source: int | str) -> bool:
        """Whether ``f``, fetched into ``tmp`` from ``source`` (a holder's rank, or
        "the backup"), fails the SHA-256 ``want`` names for it; such a file is
        removed, counted and logged."""
        sha = want.get(f.path) if want is not None else None
        if not sha:
            return False
        dest = inside(tmp, f.path)
        try:
            if file_sha256(dest) == sha:
                return False
        except OSError:
            pass
        dest.unlink(missing_ok=True)
        self.metrics.unproven.inc()
        log.warning("rank %d: %s of step %d from %s is not the bytes its origin signed "
                    "(size and CRC32C match): trying the next source", self.rank, f.path,
                    step, source if isinstance(source, str) else f"rank {source}")
        return True

    def _fetch(self, sources: list[tuple[int, int]], step: int, f: FileMeta, tmp: Path,
               want: Mapping[str, bytes] | None = None, tried: Sequence[str] = ()) -> str:
        """One file from ``sources`` (``(holder, origin)``, in order), then the backup;
        a file that does not hash as ``want`` says counts as not fetched. ``tried``:
        why the sources tried already failed (the error names them too)."""
        errors: list[str] = list(tried)
        dest = inside(tmp, f.path)  # a holder's path: checked before anything is written
        dest.parent.mkdir(parents=True, exist_ok=True)
        for holder, origin in sources:
            try:
                if holder == self.rank:  # another copy held here (a data-parallel twin)
                    src = self.store.copy_dir(origin, step) / f.path
                    copy_verified(src, dest, f.size, f.crc32c)
                else:
                    self.peers[holder].fetch(step, origin, f.path, dest, f.size, f.crc32c)
                    self.metrics.bytes_fetched.inc(f.size)
                if self._unsigned(want, f, tmp, step, holder):
                    errors.append(f"rank {holder}: not the bytes rank {origin} signed")
                    continue
                return "peer"
            except (MtcError, OSError) as e:
                self.metrics.failures.labels("fetch").inc()
                log.warning("rank %d: %s of step %d from rank %d (origin %d) failed: %s",
                            self.rank, f.path, step, holder, origin, e)
                errors.append(f"rank {holder}: {_bare(e)}")
        if self.backup is not None:
            try:
                if self.backups.file_from_backup(step, f, dest):
                    if not self._unsigned(want, f, tmp, step, "the backup"):
                        return "backup"
                    errors.append("backup: not the bytes signed")
                else:
                    errors.append("backup: not backed up")
            except (MtcError, OSError) as e:
                self.metrics.failures.labels("fetch").inc()
                errors.append(f"backup: {_bare(e)}")
        raise CorruptShardError(f"no good copy on any holder ({'; '.join(errors) or 'none'})",
                                step=step, host=self.rank, path=f.path)


def _bare(e: BaseException) -> str:
    """An error's message without its step/host/file suffix: the error it goes into
    names them once ("(host 1) (host 0) (host 1)" otherwise)."""
    if not isinstance(e, MtcError):
        return str(e)
    return e.message
