"""Is a command's executable a Python interpreter (pure)? The one rule: msrun drops it (it runs
`python script` itself), `orch check` asks it for the versions of the job's Python packages."""

from __future__ import annotations

import posixpath
import re

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")


def is_python(executable: str) -> bool:
    """python, python3, /usr/bin/python3.11: yes; pythonw, ipython, bash: no."""
    return bool(_PYTHON.match(posixpath.basename(executable)))
