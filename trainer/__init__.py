"""The demo trainers and the local cluster users run (``make demo``, ``make chaos``,
``mtc-cluster``, mtc.testing's plugin): they ship in the wheel. What only the tests
or the benchmarks use lives in ``tests/`` or ``bench/`` instead."""
