"""Other implementations put under the suites: each a thin module over code this project did not write.

``pytest --impl implementations.<name>`` judges one; its ``CAPABILITIES`` say which suites apply, its
``xfails.txt`` lists its known gaps (docs/implementing.md).
"""
