"""What a process said, read for the words that name what went wrong (pure: text in, text out)."""

from __future__ import annotations

import re

NAMES_AN_ERROR = re.compile(r"error|unable|fail|cannot|can't|could not|not found|no such|refused|denied|abort|"
                            r"non-zero|killed|signal|timed? ?out|unreachable|invalid|illegal", re.I)


def launcher_words(text, lines=12, limit=2000):
    """A launcher's last words, each indented: what stands outside OpenMPI's ------ blocks (ssh's
    own error, a rank's last words) line by line, and of each block the part that says what went
    wrong, whole: from the paragraph whose line first names an error to the line naming the node
    ("Node: ..."), or to the end of that paragraph when no node is named; never its advice. The
    last items that fit in `lines` (the last one always, whole, within `limit` characters)."""
    items: list[list[str]] = []
    block: list[str] = []
    inside = False
    for ln in text.splitlines():
        bare = ln.strip()
        if len(bare) >= 10 and set(bare) <= set("-="):
            if inside and block:
                items.append(_block_words(block))
            inside, block = not inside, []
        elif inside:
            block.append(ln.rstrip())
        elif bare:
            items.append([ln.rstrip()])
    if inside and block:   # a block the log ends in the middle of
        items.append(_block_words(block))
    kept: list[str] = []
    for item in reversed([i for i in items if i]):
        if kept and len(kept) + len(item) > lines:
            break
        kept[:0] = item
    out = "\n".join("  " + ln for ln in kept)
    return out if len(out) <= limit else out[:limit - 3] + "..."


def _block_words(block):
    paras, cur = [], []
    for ln in block + [""]:
        if ln.strip():
            cur.append(ln)
        elif cur:
            paras.append(cur)
            cur = []
    if not paras:
        return []
    start = next((i for i, p in enumerate(paras) if any(NAMES_AN_ERROR.search(ln) for ln in p)), 0)
    rest = [ln for p in paras[start:] for ln in p]
    node = next((i for i, ln in enumerate(rest) if ln.strip().startswith("Node:")), None)
    return rest[:node + 1] if node is not None else paras[start]
