"""Controller side of restoring: which step (the hosts' own, or the replicators'
agreement across every tier), loading it, healing a corrupt shard once, and
what the last restore read from where.

Only the controller's thread of a manager uses a :class:`RestoreFlow`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import jax

from mtc import layout, multihost, orbax_args
from mtc.dispatch import Dispatch
from mtc.dispatch.protocol import Survey
from mtc.errors import (
    AgreementError,
    ConfigError,
    CorruptShardError,
    ManifestError,
    MtcError,
    ShardUnavailableError,
    StepNotFoundError,
)
from mtc.inventory import StepInventory
from mtc.options import Options
from mtc.pool import ThreadPool
from mtc.replicas import ReplicatorTier, farthest
from mtc.restore.load import custom_of, metrics_of, saved_at_of
from mtc.restore.plan import SavedStep
from mtc.restore.step import StepReader
from mtc.save.flow import SaveFlow
from mtc.topology import Topology

if TYPE_CHECKING:
    from mtc.replicas import Prepared

# The manager's log lines keep one logger name, the one users configure.
log = logging.getLogger("mtc.manager")


class RestoreFlow:
    """Restores of one manager, and what the last one read from where.

    ``where`` names, in errors, where the user configured the steps to be (the
    sidecars' RAM disks, or a folder)."""

    def __init__(self, dispatch: Dispatch, topology: Topology, options: Options,
                 inventory: StepInventory, reader: StepReader, saves: SaveFlow, *,
                 where: str) -> None:
        self.dispatch = dispatch
        self.topology = topology
        self.options = options
        self.inventory = inventory
        self.reader = reader
        self.saves = saves
        # No network tier: this process plans every host.
        self._local_only = not dispatch.networked()
        self._where = where
        self._tier_: ReplicatorTier | None = None  # made when first asked (see tier)
        # A step the replicators prepared for latest_step(), not yet restored.
        self._prepared: Prepared | None = None
        self.last_restore_tiers: dict[int, str] = {}
        self.last_restore_tier: str | None = None
        self.last_restore_seconds: dict[str, float] = {}
        self.last_restore_step: int | None = None  # the step the last restore loaded

    def reload(self) -> None:
        """Forget any step the replicators prepared for ``latest_step``."""
        self._prepared = None

    def new_step_coming(self) -> None:
        """A save is reaching the hosts: a step prepared by the replicators is stale."""
        self._prepared = None

    @property
    def tier(self) -> ReplicatorTier:
        """The replicators, made on first use: a manager whose replicator addresses
        do not match its hosts still saves; its first restore says so."""
        if self._tier_ is None:
            self._tier_ = ReplicatorTier(self.options, self.topology)
        return self._tier_

    # -- which step ---------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps complete on every host, and those this manager is still saving:
        listed once ``save`` returned, as Orbax's; a restore (or reading the step's
        manifests) waits for its save to commit first, so nothing uncommitted is read.
        A staged step not newer than the newest complete one has committed, and is
        listed only while the hosts hold it (retention may have freed it since)."""
        complete = self.inventory.common()
        newest = complete[-1] if complete else -1
        return sorted(set(complete) | {s for s in self.saves.staged if s > newest})

    def latest_step(self) -> int | None:
        if not self.options.replicators:
            steps = self.steps()
            if not steps:
                self._nothing_restorable()
            return steps[-1] if steps else None
        if self._prepared is None:
            self.saves.wait_saves()  # the replicators see what this job committed
            self._prepared = self._prepare_with_replicators(background=self._may_defer())
        step = self._prepared.step
        if step is None:
            if self._prepared.lost:
                self._nothing_restorable(self._prepared.lost)
            steps = self.inventory.common()
            return steps[-1] if steps else None
        if multihost.common_steps([step]) != [step]:
            raise AgreementError("processes were told different steps by their replicators",
                                 step=step)
        log.info("mtc: latest step %d, agreed by every host (tier: %s)", step,
                 self.last_restore_tier)
        return step

    def _nothing_restorable(self, lost: str = "") -> None:
        self.inventory.nothing_restorable(
            lost, start_over=self.options.if_data_lost != "raise",
            read_only=self.options.read_only)

    def metrics(self, step: int) -> Any:
        try:
            saved = self.reader.saved_step(step)
        except StepNotFoundError:
            return None  # as Orbax's metrics() of a step it does not have
        return metrics_of(saved)

    def saved_at(self, step: int) -> float | None:
        """When ``step``'s save began (seconds since the epoch), from its manifest;
        None where the step is gone or its manifest does not say."""
        try:
            return saved_at_of(self.reader.saved_step(step))
        except (StepNotFoundError, ManifestError):
            return None  # no time known: the time-based policies keep the step

    def custom_metadata(self, step: int) -> Any:
        """Orbax's ``custom_metadata`` saved with ``step`` ({}: none)."""
        return custom_of(self.reader.saved_step(step))

    # -- restore ------------------------------------------------------------------------

    def restore(self, step: Any, target: Any, args: Any, *, as_numpy: bool = False) -> Any:
        if orbax_args.is_orbax_args(target) or orbax_args.is_orbax_args(step):
            raise ConfigError(orbax_args.positional_hint("restore").replace(
                "ocp.args.StandardSave(state)", "ocp.args.StandardRestore(target)"))
        if args is not None and target is not None:
            raise ConfigError("restore() takes target or args=, not both")
        t0 = time.perf_counter()
        self.saves.finish_for_restore()
        requested = None if step is None else layout.as_step(step)
        tiers = {h: "local" for h in self.topology.local_hosts}
        prepared: Prepared | None = None
        survey: Survey | None = None  # the hosts' steps and manifests, when asked already
        if step is not None:
            step = layout.as_step(step)
            if self._prepared is not None and self._prepared.step == step:
                prepared = self._prepared
                tiers = self.tier.host_tiers(prepared)
        elif self.options.replicators:
            # A fresh agreement: hosts may have been lost since latest_step() asked.
            if self._prepared is not None:
                prepared = self._prepared
            else:
                prepared, survey = self._prepare_surveying()
            step, tiers = prepared.step, self.tier.host_tiers(prepared)
            if step is None:
                self._nothing_restorable(prepared.lost)
                raise StepNotFoundError("the replicators agree that no step can be restored "
                                        "on this job's hosts (none was saved, or none "
                                        "completely)")
        self._prepared = None
        t_prepared = time.perf_counter()
        if step is None:
            steps = self.inventory.common(manifests=True)
            survey = self.inventory.last_survey  # the step's manifests, when newest
            if not steps:
                self._nothing_restorable()
                raise StepNotFoundError(f"no step is committed on every host of this job "
                                        f"({self._where})")
            step = steps[-1]
        run = prepared.run if prepared is not None and prepared.step == step else ""
        if not run:  # no agreed run: that the hosts' copies are one run's is asked here
            self.inventory.check_one_run(step)
        error: MtcError | None = None
        result: Any = None
        nbytes = 0
        self.last_restore_seconds = {}
        fetched_before = self.dispatch.network_bytes()
        try:
            saved, result = self._load(step, target, args, prepared, run, survey,
                                       as_numpy)
            nbytes = sum(m.nbytes for m in saved.manifests.values())
        except MtcError as e:
            error = e
        # A shard that failed verification while loading was quarantined by the
        # host that read it; its replicator fetches a verified copy from another
        # holder when asked to prepare again. Once, within the restore timeout,
        # and every process together (the replicators agree again).
        if self.options.replicators and multihost.any_process(
                isinstance(error, CorruptShardError)):
            left = self.options.restore_timeout_s - (time.perf_counter() - t0)
            log.warning("restore of step %d found a corrupt shard (%s); healing through "
                        "the replicators (%.0fs left)", step, error, left)
            if left > 0:
                try:
                    prepared = self._prepare_with_replicators(timeout_s=left)
                    healed = prepared.step
                    if healed is None or (requested is not None and healed != requested):
                        raise StepNotFoundError(f"after healing, the replicators agree on "
                                                f"step {healed}", step=requested)
                    step, error, tiers = healed, None, self.tier.host_tiers(prepared)
                    saved, result = self._load(step, target, args, run=prepared.run,
                                               as_numpy=as_numpy)
                    nbytes = sum(m.nbytes for m in saved.manifests.values())
                except MtcError as e:
                    error = e
        # Every process fails together, or none: a process that restored while
        # another could not would deadlock the job at its next collective.
        if multihost.any_process(error is not None) and error is None:
            error = ShardUnavailableError("another process could not restore this step",
                                          step=step)
        if error is not None:
            raise error
        if self.dispatch.network_bytes() > fetched_before:
            # Regions this process read from other hosts' copies, over the network.
            tiers = {h: farthest({0: t, 1: "peer"}) for h, t in tiers.items()}
        self.last_restore_tiers = tiers
        self.last_restore_tier = farthest(tiers)
        self.last_restore_step = step
        self.last_restore_seconds.update({"prepare": t_prepared - t0,
                                          "load": time.perf_counter() - t_prepared})
        if prepared is not None and prepared.step == step:
            # Once the restored arrays are in place the load no longer needs the
            # hosts' CPUs: a replaced host's own copy starts coming now (at the
            # background's priority), not when its replicator's quiet time ends.
            jax.block_until_ready(result)
            self.tier.restored(prepared)
        # Newer steps an earlier run left incomplete are deleted; a newer step every
        # host committed stays, whichever step was restored (mtc.fencing). With
        # replicators they fence their own hosts when they agree on the newest step.
        if not self.options.replicators and not self.options.read_only:
            self.inventory.fence_after(step, self.saves.run, saved.listed)
        self.inventory.relearn()
        self.saves.restored(step)
        log.info("mtc: restored step %d: %d bytes in %.3fs from the %s tier (hosts: %s)",
                 step, nbytes, time.perf_counter() - t0, self.last_restore_tier,
                 ", ".join(f"{h}={t}" for h, t in sorted(tiers.items())))
        return result

    def _load(self, step: int, target: Any, args: Any, prepared: Prepared | None = None,
              run: str = "", survey: Survey | None = None,
              as_numpy: bool = False) -> tuple[SavedStep, Any]:
        """The step's saved tree and ``target`` loaded from it (mtc.restore.step);
        the hosts whose data ``prepared`` says is on its way are waited for only
        where the other hosts' copies do not cover their regions."""
        if prepared is None or not prepared.pending:
            return self.reader.load(step, target, args, run=run, survey=survey,
                                    as_numpy=as_numpy)
        tier = self.tier
        return self.reader.load(step, target, args, pending=tier.pending_hosts(prepared),
                                wait_pending=lambda: tier.wait_local(prepared),
                                seconds=self.last_restore_seconds, run=run, survey=survey,
                                pending_timeout_s=self.options.restore_timeout_s,
                                as_numpy=as_numpy)

    def _may_defer(self) -> bool:
        """Whether a restore may start before every host's data is local: this
        process plans the reads of every host (one controller), so it can read a
        replaced host's regions from other hosts' copies."""
        return (self.options.restore_while_fetching and self._local_only
                and len(self.topology.local_hosts) == self.topology.num_hosts)

    def _prepare_surveying(self) -> tuple[Prepared, Survey | None]:
        """The replicators' agreement, and meanwhile (this process plans every host)
        every host's steps with its newest step's manifest, asked of the hosts in
        one call: the survey the load needs when the agreed step is each holder's
        newest, the common case (else the load asks again, as it always did). The
        agreement talks only to the replicators, on a thread of its own; the hosts
        are asked from this one. A survey that fails is dropped: the load asks
        again and raises what it finds."""
        if not self._local_only:
            return self._prepare_with_replicators(background=self._may_defer()), None
        agreeing = ThreadPool(1, "mtc-agree")
        try:
            agreed = agreeing.submit(self.tier.prepare, None, background=self._may_defer())
            try:
                survey: Survey | None = self.dispatch.survey(self.topology.local_hosts, None)
            except MtcError as e:
                log.debug("mtc: the hosts' survey beside the agreement failed: %s", e)
                survey = None
            prepared = agreed.result()
        finally:
            agreeing.shutdown(wait=True)
        if survey is not None and not self._survey_still_holds(survey, prepared):
            survey = None
        self.last_restore_tiers = self.tier.host_tiers(prepared)
        self.last_restore_tier = farthest(self.last_restore_tiers)
        return prepared, survey

    def _survey_still_holds(self, survey: Survey, prepared: Prepared) -> bool:
        """Whether a survey taken during the agreement says what the hosts hold
        after it: every host lists the agreed step (or its data is on its way), as
        the agreed run wrote it. An agreement that made a host's data local, or put
        the agreed run's copy in place of another's, changed what the hosts hold."""
        step = prepared.step
        if step is None:
            return False
        pending = self.tier.pending_hosts(prepared)
        if any(step not in survey.held.get(h, ()) for h in self.topology.local_hosts
               if h not in pending):
            return False
        return not prepared.run or all(m.run == prepared.run for m in survey.manifests.values()
                                       if m.step == step)

    def _prepare_with_replicators(self, timeout_s: float | None = None, *,
                                  background: bool = False) -> Prepared:
        """The replicators' agreement and each local host's data made local (or,
        ``background``, on its way): see :meth:`ReplicatorTier.prepare`."""
        prepared = self.tier.prepare(timeout_s, background=background)
        self.last_restore_tiers = self.tier.host_tiers(prepared)
        self.last_restore_tier = farthest(self.last_restore_tiers)
        return prepared
