"""`orch up`'s prepare facts read by up's check probe, not in a round trip of their own
(orchestrator/prepare.py owns the facts, their script and which section reads each): the probe's
own `prepare` section, for the facts no check reads. Not a check: it gives no result, so no row
in the report; the facts reach `up` through Report.prepared."""

from __future__ import annotations

from ..prepare import probe_section
from .base import Probe

PREPARE = Probe("prepare", lambda plan, host: probe_section(plan))
