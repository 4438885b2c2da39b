"""``python -m fineflow.cli``: the ``fineflow`` command without the installed script."""

from fineflow.cli import main

raise SystemExit(main())
