"""``python -m cli``: the ``epd`` command, as the launcher starts each service."""

from cli.commands import main

raise SystemExit(main())
