"""The restore agreement: the one decision of which step every host restores (the
pure rule in :mod:`.decision`), the decider that makes it once per epoch and keeps it
(:mod:`.agreement`, :mod:`.book`), and a replicator's part in it
(:mod:`.node_agreement`). Runs in the replicator process (``mtc-replicator``)."""
