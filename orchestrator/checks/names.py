"""The names of orch check's checks, in the order the report shows them (table columns, JSON
results, `checks.skip` in cluster.yaml). Tiny on purpose: spec.py validates `checks.skip`
against it without importing the checks themselves (probes, transports).

Each name is registered by exactly one module of this package (base.register); a check that is
not listed here, or a name no module registers, fails at once (base.registered).
"""

KNOWN_CHECKS = ("ssh", "mesh", "reach", "user", "versions", "path", "nic", "devices", "device-rules",
                "workdir", "disk", "files", "ports", "stale", "clock", "health")
