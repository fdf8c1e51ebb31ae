"""A restore's fetch on one host: after the agreement, this host's data of the agreed
step brought local from its own RAM disk, a peer's copy or the backup, every byte
verified (:mod:`.restore` asks, :mod:`.materialize` places, :mod:`.fetch_plan` plans
where each file comes from). Runs in the replicator process."""
