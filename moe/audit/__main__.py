"""``python -m moe.audit`` is ``moe-audit``."""

from moe.audit.cli import console_main

raise SystemExit(console_main())
