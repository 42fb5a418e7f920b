"""Tooling around the library: the ``jaxcomm`` command and what it runs.

``cli`` (the command), ``bench`` (``jaxcomm bench``), ``demo`` (``jaxcomm demo``), ``textdata``
(the demo's offline corpus), ``launch`` (local multi-process launcher, shaped loopback) and
``_delay`` (link delay without netem). ``import jaxcomm`` imports none of these; they import the
library, never the other way round.
"""
