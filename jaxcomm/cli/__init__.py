"""The ``jaxcomm`` command and what it runs (not library: the library never imports it).

``main`` (the command: ``jaxcomm`` / ``python -m jaxcomm``), ``bench`` (``jaxcomm bench``),
``demo`` (``jaxcomm demo``, its report in ``demo_report``), ``launch`` (``jaxcomm launch``:
local multi-process launcher, shaped loopback), ``models`` (the demo's and the convergence
benchmark's byte-level transformer and offline byte corpus), ``textdata`` (the examples' offline
character corpus), ``_text`` (docstrings as ``--help`` text), ``_delay`` (link delay without
netem), ``_proc`` (helper processes) and ``_paths`` (output paths checked before work).
``import jaxcomm`` imports none of these; they import the library, never the other way round.
"""
