"""A host's storage primitives: the one place a host's processes (the sidecar, the
replicator, the backups) rename, checksum, copy and delete files on their RAM disk
(only a host's own processes touch it), and the names and reserve they use.

- :mod:`.names`: temporary and half-deleted names, one scheme (never read as a step
  or an object);
- :mod:`.publish`: renames: a folder or file published under a name nothing holds
  (``renameat2(RENAME_NOREPLACE)``), a file replaced, a file written whole or not at
  all, each synced on request;
- :mod:`.checksum`: a file's CRC32C and SHA-256 in one pass, a verified copy;
- :mod:`.spare`: the RAM disk's last bytes, never promised to anyone;
- :mod:`.deleter`: a step hidden first, then removed (in the background by a
  :class:`~.deleter.Deleter` its owner closes), and leftovers cleaned;
- :mod:`.reserve`: blank RAM-disk files set aside for the next save's or peer
  copy's files of known sizes;
- :mod:`.quarantine`: files that failed verification, moved out of every step
  (by a restore's reader and by the replicator's scrub).
"""
