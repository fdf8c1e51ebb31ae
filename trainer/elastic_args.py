"""The elastic trainer's command line (``python -m mtc.trainer.elastic --help``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mtc.trainer.device_memory import DEFAULT as DEVICE_MEMORY
from mtc.trainer.device_memory import MODES
from mtc.trainer.model import PRESETS
from mtc.trainer.policy import PAUSE_POLICIES

DESCRIPTION = "The elastic trainer: one training process that survives losing a host or a slice."


def _steps(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--cluster", type=Path, required=True,
                   help="the local cluster's folder (holding cluster.json)")
    p.add_argument("--log", type=Path, required=True, help="JSON-lines output")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--model", choices=sorted(PRESETS), default="small",
                   help="model size preset (small: 3.2M parameters; tiny: 0.4M, for tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (kept on resize)")
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--host-loss-at", type=_steps, default=[],
                   help="lose --lost-host after the save of the first step at or after each "
                        "of these (comma-separated) steps")
    p.add_argument("--host-loss-every-s", type=float, default=0.0, metavar="S",
                   help="also lose --lost-host after the first save once S seconds have "
                        "passed since the last failure (or the first step); 0: off")
    p.add_argument("--host-loss-when", choices=("replicated", "mid-save"), default="replicated",
                   help="lose the host once that save is on its peer, or while it is written")
    p.add_argument("--lost-host", type=int, default=1)
    p.add_argument("--host-return-s", type=float, default=1.5,
                   help="seconds until the lost host is back (empty)")
    p.add_argument("--slice-loss-at", type=_steps, default=[],
                   help="lose --lost-slice while the first step at or after each of these "
                        "(comma-separated) runs on every slice")
    p.add_argument("--lost-slice", type=int, default=1)
    p.add_argument("--slice-down-steps", type=int, default=25,
                   help="the lost slice comes back after this many steps on the survivors")
    p.add_argument("--pause-timeout-s", type=float, default=10.0,
                   help="how long to wait for missing slices whose hosts are being replaced "
                        "before resizing without them (woken when they are back)")
    p.add_argument("--pause-policy", choices=PAUSE_POLICIES, default="resize",
                   help="pause for missing slices only while the cluster replaces their hosts "
                        "(replacement), after every failure (always), or never: train on "
                        "the healthy slices meanwhile and scale back up (resize)")
    p.add_argument("--poll-s", type=float, default=0.2,
                   help="pathwaysutils health-check and monitor interval")
    p.add_argument("--compile-ahead", type=int, default=1, metavar="N",
                   help="compile the step ahead, in the background, for every mesh with up "
                        "to N slices fewer than the one training runs on, and for the way "
                        "back up (0: compile when needed)")
    p.add_argument("--compile-ahead-nice", type=int, default=10, metavar="N",
                   help="compile ahead at this much lower OS priority than the loop")
    p.add_argument("--compile-cache", default="",
                   help="JAX persistent compilation cache folder or URL (default: "
                        "<cluster>/compile-cache; 'none': off)")
    p.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                   help="no per-step in-memory snapshot (resize restores from mtc)")
    p.add_argument("--dispatch", choices=("colocated", "process"), default="colocated",
                   help="how mtc reaches the hosts' sidecars: colocated Python programs "
                        "they run (Pathways' path, the default: a cluster up with "
                        "--colocated-devices), or seam requests")
    p.add_argument("--no-reference", dest="reference", action="store_false")
    p.add_argument("--device-memory", choices=MODES, default=DEVICE_MEMORY,
                   help="the CPU devices' memory: reused as an accelerator's pool reuses "
                        "it (default), or mapped fresh for every buffer as glibc does by "
                        "default (mtc.trainer.device_memory)")
    return p.parse_args(argv)
