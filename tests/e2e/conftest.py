"""`lab_factory` from tests/integration/conftest.py, re-exported so the end-to-end training
tests make their labs the same way (skip only without root or network namespaces; with CI
set, fail instead).

Not `lab`: re-exported here it would be a second session fixture making a second lab with
the same name (``t<pid>``) as tests/integration's, replacing it while it is in use.
"""

from tests.integration.conftest import lab_factory  # noqa: F401
