"""Host-side work that can wait, run behind the job's own threads.

A replicator shares its host's CPUs with the job's input pipeline and, on a
machine like this one, with the trainer itself. Work no step waits for (a
replaced host's own copy coming back, blank RAM-disk space set aside for the next
copy) runs on threads lowered to ``BACKGROUND_NICE``: Linux gives each thread a
nice of its own, so only those threads yield.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 19


def lower_this_thread(what: str) -> None:
    """This thread at ``BACKGROUND_NICE``; where that is refused it runs as it is
    (logged, naming ``what``). A thread pool's initializer, or a thread's first act."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError) as e:
        log.warning("%s keeps its priority: %s", what, e)
