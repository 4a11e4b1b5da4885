"""Command line: the ``dsv4-lora`` commands and what they run.

``main`` (argument parsing, the entry point), ``qualify`` (the whole contract on one base), ``verify``
(``verify-adapter``), ``launch`` (the one rank launcher, gloo spawn or torchrun, which the test suites' runner
uses too; ``spawn`` holds its process mechanics, ``rank_report`` its per-rank results and report). The recipes
the command line runs live in ``impl.recipe``. ``python -m impl.cli`` runs the command line."""
