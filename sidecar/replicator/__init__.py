"""The replicator: one process per host that copies committed steps to peers in
other slices, agrees with the other hosts on the step to restore, and brings a
replaced host's data back from its peers."""
