"""The accelerator probe behind the copy budget's room (issue 65): how much device
memory a device-to-host transfer itself takes, and which keys the platform's
``memory_stats()`` reports. Prints JSON.

On a TPU v5e chip 88% full (2026-12-07) the budget's room fell by about 0.54 GB
after a snapshot's first copy had been brought to host memory, more than the copy
itself explains: the platform's reported peak had risen. This probe asks whether
a transfer of an array in the chip's tiled layout allocates a buffer on the
device (a relayout into host order) and how that grows with the transfers under
way at once. Each case reads the platform's ``bytes_in_use`` and
``peak_bytes_in_use`` before, while the transfers are under way (after
``copy_to_host_async``) and after they land; the peak only rises, so the cases
run from the fewest bytes under way to the most.

    python bench/probe_transfer_memory.py [--mib 64] [--arrays 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import log


def stats(device: Any) -> dict[str, int]:
    """The platform's memory figures for ``device`` ({} where it reports none)."""
    return {k: int(v) for k, v in (device.memory_stats() or {}).items()}


def case(name: str, arrays: list[jax.Array], device: Any) -> dict[str, Any]:
    """Transfers of ``arrays`` all started at once, then waited for in order:
    the rise of the platform's figures over the bytes started."""
    before = stats(device)
    for a in arrays:
        a.copy_to_host_async()
    during = stats(device)
    got = [np.asarray(a) for a in arrays]
    after = stats(device)
    started = sum(a.nbytes for a in arrays)
    out: dict[str, Any] = {
        "bytes_started": started,
        "in_use_rise_during": during.get("bytes_in_use", 0) - before.get("bytes_in_use", 0),
        "peak_rise": after.get("peak_bytes_in_use", 0) - before.get("peak_bytes_in_use", 0),
        "in_use_after_minus_before": after.get("bytes_in_use", 0) - before.get("bytes_in_use", 0),
    }
    out["peak_rise_over_started"] = round(out["peak_rise"] / started, 3)
    log(f"  {name}: {out}")
    del got
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="each array's size (f32, square)")
    p.add_argument("--arrays", type=int, default=8)
    args = p.parse_args()
    device = jax.devices()[0]
    side = int((args.mib * (1 << 20) // 4) ** 0.5)
    n = 1 + 4 + args.arrays  # each case's arrays are fresh: none has a host copy yet
    keys = jax.random.split(jax.random.key(0), n)
    first = stats(device)
    # Random values: a constant array could be stored or moved in another form.
    arrays = [jax.random.normal(k, (side, side), jnp.float32) for k in keys]
    jax.block_until_ready(arrays)
    flat = jax.random.normal(keys[0], (side * side,), jnp.float32)
    jax.block_until_ready(flat)
    cases: dict[str, Any] = {}
    cases["one_1d"] = case("one_1d", [flat], device)
    cases["one_2d"] = case("one_2d", [arrays[0]], device)
    cases["four_2d"] = case("four_2d", arrays[1:5], device)
    cases[f"all_{args.arrays}_2d"] = case("all", arrays[5:], device)
    # The same arrays again: JAX keeps an array's host copy once made, so this
    # case moves nothing (the reference for the others).
    cases["again_cached"] = case("again_cached", arrays[5:], device)
    print(json.dumps({
        "date": datetime.date.today().isoformat(),
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "path": "one process, one device: copy_to_host_async then np.asarray",
        "array_bytes": arrays[0].nbytes,
        "memory_stats_keys": sorted(first),
        "memory_stats_first": first,
        "cases": cases,
    }, indent=2))


if __name__ == "__main__":
    main()
