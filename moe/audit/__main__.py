"""``python -m moe.audit`` is ``moe-audit``."""

from moe.audit.cli import main

raise SystemExit(main())
