"""``python -m jaxcomm ARGS``: the ``jaxcomm`` command (:mod:`jaxcomm.cli.main`)."""

from jaxcomm.cli.main import main

raise SystemExit(main())
