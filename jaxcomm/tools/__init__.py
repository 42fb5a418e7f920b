"""Tooling around the library: the ``jaxcomm`` command and what it runs.

``cli`` (the command), ``bench`` (``jaxcomm bench``), ``demo`` (``jaxcomm demo``, its report in
``demo_report``), ``models`` (the demo's and the convergence benchmark's byte-level transformer
and offline byte corpus), ``textdata`` (the examples' offline character corpus), ``launch``
(local multi-process launcher, shaped loopback), ``_delay`` (link delay without netem) and
``_proc`` (helper processes). ``import jaxcomm`` imports none of these; they import the
library, never the other way round.
"""
