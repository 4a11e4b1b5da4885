"""The project's one rank launcher: spawn ranks (or run as one of torchrun's), rendezvous, run a function on every
rank, reap every process, and report each rank's result, never hanging. The command line (``dsv4-lora qualify``)
and the suites' runner (``fixtures/runner/multirank.py``) both use it; it is not the implementation under test,
imports nothing of it, and is tested by ``suites/meta/test_runner.py``.

Modules: ``launch`` (the entry points), ``spawn`` (plain processes: own session, stack dumps, reaping),
``in_process`` (one rank of a launched world), ``rank_report`` (each rank's result, the root cause),
``progress`` (a rank's progress lines, shown by the launcher), ``errors``.
"""
