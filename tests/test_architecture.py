"""docs/ARCHITECTURE.md matches the code: every thread and lock it names exists, and it names every one there is;
every `Class.member` it names exists (a class in clipd/, or a service of the .proto).

The code's threads are the names given to ``threading.Thread`` and the ``thread_name_prefix`` of thread pools
(an f-string's literal prefix: ``clipd-device-worker-{id}`` is ``clipd-device-worker-``); its locks are the
attributes and globals made with ``threading.Lock``, ``RLock``, ``Condition`` or ``Semaphore``. The page
lists them in two tables (``## Threads``, ``## Locks``) whose rows start with the name and the file, both
in backticks.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "ARCHITECTURE.md"

THREAD = re.compile(r"""(?:name|thread_name_prefix)\s*=\s*f?["'](clipd-[A-Za-z0-9_-]*)""")
STARTS_THREADS = re.compile(r"\b(?:threading\.Thread|threading\.Timer|ThreadPoolExecutor)\(")
LOCK = re.compile(r"""(?:self\.)?(\w+)(?:\s*:[^=\n]+)?\s*=\s*(?:[\w.]*defaultdict\()?threading\.(?:Lock|RLock|Condition|"""
                  r"""Semaphore)\b""")


def _in_code() -> tuple[set, set]:
    threads, locks = set(), set()
    for path in sorted((ROOT / "clipd").rglob("*.py")):
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        threads |= {(name, where) for name in THREAD.findall(text)}
        locks |= {(name, where) for name in LOCK.findall(text)}
    return threads, locks


def _in_page(section: str) -> set:
    text = PAGE.read_text()
    match = re.search(rf"^## {section}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/ARCHITECTURE.md has no '## {section}' section"
    rows = re.findall(r"^\|\s*`([^`]+)`\s*\|\s*`([^`]+)`", match.group(1), re.M)
    assert rows, f"docs/ARCHITECTURE.md: no rows in '## {section}'"
    return set(rows)


def test_the_code_has_threads_and_locks_to_compare():
    threads, locks = _in_code()
    assert ("clipd-submit-reader", "clipd/server/rpc/service.py") in threads  # the patterns still find them
    assert ("cond", "clipd/server/aggregations.py") in locks


def _call_text(text: str, start: int) -> str:
    """The text of the call whose opening parenthesis ends at ``start``, and the line after it."""
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    return text[start:text.find("\n", text.find("\n", end) + 1)]


def test_every_thread_the_code_starts_has_a_name():
    """A thread without a name is one the page can't list: every Thread, Timer and pool is named (in the
    call, or, for a Timer, on the line after it)."""
    unnamed = []
    for path in sorted((ROOT / "clipd").rglob("*.py")):
        text = path.read_text()
        for match in STARTS_THREADS.finditer(text):
            if not THREAD.search(_call_text(text, match.end())):
                unnamed.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}")
    assert unnamed == []


def test_every_thread_on_the_page_exists_and_every_thread_is_on_the_page():
    threads, _ = _in_code()
    page = _in_page("Threads")
    assert page - threads == set(), "named in docs/ARCHITECTURE.md, not in the code"
    assert threads - page == set(), "in the code, not in docs/ARCHITECTURE.md"


def test_every_lock_on_the_page_exists_and_every_lock_is_on_the_page():
    _, locks = _in_code()
    page = _in_page("Locks")
    assert page - locks == set(), "named in docs/ARCHITECTURE.md, not in the code"
    assert locks - page == set(), "in the code, not in docs/ARCHITECTURE.md"


def _members_in_code() -> dict[str, set[str]]:
    """Every class in clipd/ with the names it defines (methods, properties, fields, class and instance
    attributes), its bases' included; and the gRPC services of the .proto with their RPCs."""
    import ast

    classes: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for path in sorted((ROOT / "clipd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = classes.setdefault(node.name, set())
                bases.setdefault(node.name, []).extend(b.id for b in node.bases if isinstance(b, ast.Name))
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                        for sub in ast.walk(item):  # self.name = ... (instance attributes)
                            targets = sub.targets if isinstance(sub, ast.Assign) else \
                                [sub.target] if isinstance(sub, ast.AnnAssign) else []
                            names |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                                      and isinstance(t.value, ast.Name) and t.value.id == "self"}
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    for path in sorted((ROOT / "proto").rglob("*.proto")):
        for service, body in re.findall(r"^service (\w+) \{(.*?)^\}", path.read_text(), re.S | re.M):
            classes.setdefault(service, set()).update(re.findall(r"^\s*rpc (\w+)\(", body, re.M))

    def with_bases(name: str, seen=()) -> set[str]:
        out = set(classes.get(name, ()))
        for base in bases.get(name, ()):
            if base not in seen:
                out |= with_bases(base, (*seen, name))
        return out

    return {name: with_bases(name) for name in classes}


def test_every_class_member_the_page_names_exists():
    members = _members_in_code()
    named = set(re.findall(r"`([A-Z]\w*)\.([a-z_]\w*)", PAGE.read_text()))
    assert named, "the page names no Class.member in backticks"
    missing = sorted(f"{cls}.{member}" for cls, member in named if member not in members.get(cls, ()))
    assert missing == [], f"docs/ARCHITECTURE.md names what the code does not have: {missing}"
