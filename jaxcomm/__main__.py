"""``python -m jaxcomm ARGS``: the ``jaxcomm`` command (:mod:`jaxcomm.tools.cli`)."""

from jaxcomm.tools.cli import main

raise SystemExit(main())
