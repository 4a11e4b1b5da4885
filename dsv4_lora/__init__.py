"""``dsv4-lora``, the command line a user runs, in its own room: it reaches an implementation only through its
driver (``dsv4_conformance.driver``) and judges it with the conformance judge, so one command qualifies any
implementation.

Moving in from ``impl/cli`` command by command; here so far: ``qualify`` (:mod:`dsv4_lora.qualify_driver`), whose
default driver is the implementation's own (``impl/driver.py``). ``verify-adapter``, ``coverage``, ``export`` and
``convert-adapter`` are still in ``impl/cli`` and call the reference implementation directly.
"""
