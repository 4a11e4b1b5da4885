"""Command line: the ``dsv4-lora`` commands and what they run.

``main`` (argument parsing, the entry point), ``qualify`` (the whole contract on one base), ``verify``
(``verify-adapter``), ``launch`` (rank launcher: gloo spawn or torchrun) and ``recipe`` (the Flash LoRA
recipe and its tiny variant). ``python -m impl.cli`` runs the command line.
"""
