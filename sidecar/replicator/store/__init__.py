"""What this host holds on its RAM disk: its own steps and peers' copies
(:mod:`.store`), their files and checksums, identical bytes held once
(:mod:`.claims`), the proofs kept with copies (:mod:`.copy_proofs`), the fence
(:mod:`.fence`), and the watch that sees a step committed. Runs in the
replicator process (the host sidecar reads its layout)."""
