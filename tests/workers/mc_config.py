"""A multi-controller job whose replicators disagree on their configuration, driven
by tests/test_multicontroller_config.py: the job and checks of ``mc_worker.py``,
each process alone on its host.

- ``misconfigured``: one host's replicator was started with another ``--nodes``
  order; ``latest_step()`` raises ``ConfigError`` on every process, within
  seconds, naming the disagreement (issue 56, item 8: the others waited the
  agreement timeout for an ``AgreementError`` that did not say why).
"""

from __future__ import annotations

import time

from mc_worker import Worker, main


class Config(Worker):
    PHASES = ("misconfigured",)

    def misconfigured(self) -> None:
        import mtc

        t0 = time.monotonic()
        try:
            mgr = self.manager()
            try:
                got = mgr.latest_step()
                self.check(False, f"latest_step() answered {got!r} with a replicator refusing")
            finally:
                mgr.close()
        except mtc.MtcError as e:
            self.summary["latest_step"] = [type(e).__name__, str(e)]
        self.summary["waited"] = round(time.monotonic() - t0, 2)


if __name__ == "__main__":
    raise SystemExit(main(Config))
