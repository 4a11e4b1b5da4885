"""``dsv4-lora``, the command line a user runs, in its own room: it reaches an implementation only through its
driver (``dsv4_conformance.driver``) and judges it with the conformance judge, so one command qualifies any
implementation.

Moving in from ``impl/cli`` command by command; here so far: ``qualify --driver MODULE``
(:mod:`dsv4_lora.qualify_driver`). What is still in ``impl/cli`` calls the reference implementation directly.
"""
