"""``python -m ember_server`` runs the ``ember`` command."""

from ember_server.cli.main import main

raise SystemExit(main())
