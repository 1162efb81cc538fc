"""Pure: the shell text orch sends to hosts for environments, exit codes and a run's processes,
and the Secret values that text may carry. (Log listings and gathering are runlogs.gather_script's:
a tar stream, or one python program, runlogs.GATHER_PY.)

Every function returns a POSIX sh snippet with every value `shlex.quote`d; nothing here runs
anything. (The hosts' supervisor, orchestrator/agent, runs alone there, stdlib only: it keeps its own Python
reading of /proc/*/environ, `procs.run_pids`.)

A Secret is a str holding the real value: whatever runs a command (a script, an environment,
the supervisor's configuration) gets the value by using it as any str. What is printed or
recorded goes through `shown`/`shown_env`/`shown_join`, which put MASK (or the Secret's own
masked form) in its place: masking happens by type, not by searching text afterwards.
Values become Secret in the model (model.Job / model.Cluster), where `Job.is_secret` is known.
"""

from __future__ import annotations

import shlex
from typing import Any, Callable, Iterable, Mapping, TypeVar

T = TypeVar("T")

MASK = "***"
MIN_MASKED = 6  # mask_values: shorter values are not searched for (they would hit unrelated text)
PROC_ENVIRON = "/proc/[0-9]*/environ"  # every process's environment (NAME=VALUE, NUL-separated)


# --------------------------------------------------------------------------- secret values


class Secret(str):
    """A secret value: the real text as a str (what runs), `shown` where it is printed or
    recorded (MASK, or the value with the secret parts masked for a word that holds one)."""

    shown: str

    def __new__(cls, value: str, shown: str = MASK) -> Secret:
        s = super().__new__(cls, value)
        s.shown = shown
        return s

    def __repr__(self) -> str:
        return f"Secret({self.shown!r})"

    def __reduce__(self) -> tuple[type[Secret], tuple[str, str]]:
        return (Secret, (str(self), self.shown))


def shown(value: T) -> T | str:
    """What may be printed or recorded for `value`: a Secret's masked form, anything else as is."""
    return value.shown if isinstance(value, Secret) else value


def shown_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: shown(v) for k, v in env.items()}


_PLAIN = frozenset((str, int, float, bool, type(None)))


def shown_tree(value: Any) -> Any:
    """A JSON-ready structure (dicts, lists, tuples) with every Secret in it masked: what a record
    written to disk holds, whatever put a Secret where. The plain types are told by their type
    first: isinstance against typing's Mapping is an ABC check, and run.json at 128 x 8 holds
    ~70,000 values (26 -> 6 ms a save)."""
    kind = type(value)
    if kind in _PLAIN:   # a Secret is a str of its own type: not plain
        return value
    if kind is dict:
        return {k: shown_tree(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return [shown_tree(v) for v in value]
    if isinstance(value, Mapping):
        return {k: shown_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [shown_tree(v) for v in value]
    return shown(value)


def secrets_in(value: Any) -> list[str]:
    """Every Secret value in a JSON-ready structure (dicts, lists, tuples)."""
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in secrets_in(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in secrets_in(v)]
    return [value] if isinstance(value, Secret) else []


def shown_join(argv: Iterable[str]) -> str:
    """An argv as a printed/recorded command line: shlex.join, Secret words masked."""
    return shlex.join(shown(a) for a in argv)


def mark(env: Mapping[str, str], is_secret: Callable[[str], bool]) -> dict[str, str]:
    """`env` with the values of its secret variables made Secret (those already Secret kept)."""
    return {k: (Secret(v) if is_secret(k) and not isinstance(v, Secret) else v) for k, v in env.items()}


def mask_values(text: str, secrets: Iterable[str]) -> str:
    """Replace each of `secrets` (and each line of a multi-line one) in `text` by MASK. A search
    over free text, for the user's own text only (the cluster file, job.command's words); values
    shorter than MIN_MASKED are left."""
    values = set()
    for v in secrets:
        values.add(str(v))
        values.update(ln.strip() for ln in str(v).splitlines())
    for v in sorted(values, key=len, reverse=True):
        if len(v) >= MIN_MASKED:
            text = text.replace(v, MASK)
    return text


def mark_words(words: Iterable[str], secrets: Iterable[str]) -> tuple[str, ...]:
    """Words of the user's command holding a secret value become Secret, shown with it masked."""
    secrets = list(secrets)
    out = []
    for w in words:
        m = w if isinstance(w, Secret) else mask_values(w, secrets)
        out.append(w if m == w else Secret(w, m))
    return tuple(out)


# --------------------------------------------------------------------------- environments


def check_name(name: str) -> str:
    """A variable name as sh takes it; a bad one is a bug, never quoted away."""
    if not name or not name.replace("_", "a").isalnum() or name[0].isdigit() or not name.isascii():
        raise ValueError(f"bad environment variable name {name!r}")
    return name


def exports(env: Mapping[str, str] | None) -> list[str]:
    """`export NAME='value'` lines (every value quoted, a Secret's real value)."""
    return [f"export {check_name(k)}={shlex.quote(str(v))}" for k, v in (env or {}).items()]


def assignments(env: Mapping[str, str]) -> str:
    """`NAME='value' NAME2=...`: variables for one command (prefix it)."""
    return " ".join(f"{check_name(k)}={shlex.quote(str(v))}" for k, v in env.items())


def with_env(env: Mapping[str, str], body: str) -> str:
    """`body` run in a subshell with these variables exported (as is without any)."""
    if not env:
        return body
    return "(\n" + "\n".join(exports(env)) + f"\n{body}\n)"


# --------------------------------------------------------------------------- exit codes


def record_exit(inner: str, rc_file: str) -> str:
    """Run `inner` and write its exit code to `rc_file` (atomically: a reader never sees half of
    it), then exit with it. The recording shell's own stderr is /dev/null: its note about a child
    killed by a signal ("Killed", "Terminated") is not the command's output."""
    q, tmp = shlex.quote(rc_file), shlex.quote(rc_file + ".tmp")
    return (f"exec 3>&2 2>/dev/null\n( exec 2>&3 3>&-\n{inner}\n)\nrc=$?\n"
            f"echo $rc > {tmp} && mv -f {tmp} {q}\nexit $rc")


# --------------------------------------------------------------------------- a run's processes


def env_holders(name: str, value: str) -> str:
    """Prints /proc/PID/environ of every process whose environment holds NAME=VALUE exactly."""
    return f"grep -lzxF -- {shlex.quote(f'{check_name(name)}={value}')} {PROC_ENVIRON} 2>/dev/null"


def pids_function(name: str, value: str, fn: str = "find_pids") -> str:
    """Defines `fn`: prints the pid of every process holding NAME=VALUE but the calling shell's."""
    return f"{fn}() {{ {env_holders(name, value)} | cut -d/ -f3 | grep -vx \"$$\"; }}\n"


# of a value env_values prints (a run id's): the rest is cut; listed, not ranges (a locale's
# collation orders ranges), `-` last (a bracket expression's literal)
ENV_VALUE_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-"


def env_values(name: str) -> str:
    """Prints `/proc/PID/environ:NAME=VALUE` for every process that has NAME (any value), VALUE cut
    at its first character outside ENV_VALUE_CHARS: any user's process may set NAME, and a newline
    in its value would otherwise print lines of its choosing into the probe's output."""
    return (f"LC_ALL=C grep -a -s -z -H -o {shlex.quote('^' + check_name(name) + '=[' + ENV_VALUE_CHARS + ']*')} "
            f"{PROC_ENVIRON} | tr '\\0' '\\n'")
