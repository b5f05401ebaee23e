"""What the user's pages name in backticks exists: every repository path (``tqueue/...``,
``benchmarks/...``, ``native/...``, ``tests/...``, ``docs/...``), every ``python -m`` module,
every test named after a file (``path::test_name``) or alone, every ``tqueue.X.Y`` and every
``Class.member`` of the package, and every relative link. A page that names what was moved or
renamed fails here with all its misses listed at once, not one per run."""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["docs/performance.md", "docs/reliability.md"]

_ROOTS = ("tqueue", "benchmarks", "native", "tests", "docs")
_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*)" % "|".join(_ROOTS))
_MODULE = re.compile(r"-m\s+((?:benchmarks|tqueue)(?:\.\w+)+)")
# a file named by a partial path (``transport/_loop.py``): it must be named from the root
_FILE = re.compile(r"^[\w.-]+(?:/[\w.*-]+)+\.(?:py|c|h|md|sh|png|txt|toml)$")
_TEST = re.compile(r"^(?:(tests/[\w/.-]+\.py|\.\.\.)::)?(test_\w+)(\.\.\.)?$")
_CLASS_MEMBER = re.compile(r"^([A-Z]\w*)\.(\w+)(?:\(\)|\s*=.*)?$")
_DOTTED = re.compile(r"^(tqueue(?:\.\w+)+)(?:\(\))?$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@functools.cache
def _classes() -> dict[str, set[str]]:
    """Each class of the package by name, with the names it defines (methods, class fields,
    ``self.x`` set in its methods) and those of its bases of the package."""
    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for path in (ROOT / "tqueue").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = own.setdefault(node.name, set())
            bases.setdefault(node.name, set()).update(b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                                                      for b in node.bases)
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item is not node:
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                if isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                                 and isinstance(t.value, ast.Name) and t.value.id == "self")

    def members(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        found = set(own.get(name, ()))
        for base in bases.get(name, set()) - seen - {name}:
            found |= members(base, seen | {name})
        return found

    return {name: members(name) for name in own}


@functools.cache
def _tests() -> dict[str, set[str]]:
    """Each test file's function names (methods of test classes included)."""
    return {str(path.relative_to(ROOT)): set(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M))
            for path in (ROOT / "tests").rglob("test_*.py")}


def _resolve_dotted(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], cut):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and attr in _classes().get(obj.__name__, ()) and i == len(parts) - 1:
                return True  # an attribute its instances set
            else:
                return False
        return True
    return False


def _misses(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    misses: list[str] = []
    last_test_file = ""
    for line_no, line in enumerate(text.splitlines(), 1):
        where = f"{page}:{line_no}"
        for target in _LINK.findall(line):
            if "://" not in target and not target.startswith("#"):
                if not (ROOT / page).parent.joinpath(target.split("#")[0]).exists():
                    misses.append(f"{where}: link ({target}) leads nowhere")
        for token in re.findall(r"`([^`\n]+)`", line):
            for path in _PATH.findall(token):
                path = path.rstrip(".")
                test = path.split("::")[0]
                if not (list(ROOT.glob(test)) if "*" in test else (ROOT / test).exists()):
                    misses.append(f"{where}: no file {test}")
                elif test.startswith("tests/") and test.endswith(".py"):
                    last_test_file = test
            for module in _MODULE.findall(token):
                base = ROOT.joinpath(*module.split("."))
                if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
                    misses.append(f"{where}: no module {module}")
            if _FILE.match(token) and not token.startswith(_ROOTS):
                misses.append(f"{where}: {token} is not named from the repository's root")
            if m := _TEST.match(token):
                file, name, prefix = m[1], m[2], m[3] is not None
                if file is None:
                    pool = set().union(*_tests().values())
                else:
                    pool = _tests().get(last_test_file if file == "..." else file, set())
                if not any(t.startswith(name) if prefix else t == name for t in pool):
                    misses.append(f"{where}: no test {name}"
                                  + (f" in {last_test_file or '(no file named before it)'}" if file == "..." else ""))
            if (m := _CLASS_MEMBER.match(token)) and m[2] not in _classes().get(m[1], ()):
                misses.append(f"{where}: {m[1]}.{m[2]}: " + ("no such member" if m[1] in _classes()
                                                             else "no class of that name in tqueue/"))
            if (m := _DOTTED.match(token)) and not _resolve_dotted(m[1]):
                misses.append(f"{where}: {m[1]} does not resolve")
    return misses


@pytest.mark.parametrize("page", PAGES, ids=[p.split("/")[-1] for p in PAGES])
def test_every_path_and_code_name_a_page_names_exists(page):
    misses = _misses(page)
    assert not misses, f"{len(misses)} names in {page} that do not exist:\n" + "\n".join(misses)


def test_the_resolver_tells_real_names_from_missing_ones(tmp_path):
    """The check itself: each kind of name, once real and once missing."""
    page = tmp_path / "page.md"
    page.write_text(
        "`tqueue/config.py` `tqueue/nope.py` `python -m benchmarks.scale` `python -m benchmarks.nope`\n"
        "`ClientConfig.checksums` `ClientConfig.nope` `Nope.x` `tqueue.config.ClientConfig` `tqueue.nope`\n"
        "`tests/test_docs_paths.py::test_the_resolver_tells_real_names_from_missing_ones` `...::test_nope`\n"
        "`transport/_loop.py` `test_every_path_and_code_name_a_page_names_exists`\n[x](nope.md)\n")
    misses = _misses(str(page))  # absolute: ROOT / page is the page itself
    assert [m.split(": ", 1)[1] for m in misses] == [
        "no file tqueue/nope.py",
        "no module benchmarks.nope",
        "ClientConfig.nope: no such member",
        "Nope.x: no class of that name in tqueue/",
        "tqueue.nope does not resolve",
        "no test test_nope in tests/test_docs_paths.py",
        "transport/_loop.py is not named from the repository's root",
        "link (nope.md) leads nowhere",
    ]



def _headings(doc: pathlib.Path) -> set[str]:
    """A page's section names, without their marks, backticks or the files in brackets after them."""
    return {re.sub(r"\s*\(`[^)]*\)$", "", line.lstrip("#").strip()).replace("`", "")
            for line in doc.read_text().splitlines() if line.startswith("#")}


_PACKAGES = ["bridges", "client", "controller", "demos", "launch", "storage", "transport", "wire"]


@pytest.mark.parametrize("package", _PACKAGES)
def test_each_package_docstring_points_at_its_sections_of_the_docs(package):
    """Each package's docstring names a page of docs/ and, in quotes after it, sections that page has."""
    doc = ast.get_docstring(ast.parse((ROOT / "tqueue" / package / "__init__.py").read_text())) or ""
    parts = re.split(r"(docs/[\w-]+\.md)", doc)
    assert len(parts) > 1, f"tqueue.{package}'s docstring names no page of docs/"
    misses = []
    for page, after in zip(parts[1::2], parts[2::2]):
        if not (ROOT / page).exists():
            misses.append(f"no page {page}")
            continue
        misses += [f'{page} has no section "{name}"' for name in re.findall(r'"([^"]+)"', after)
                   if name not in _headings(ROOT / page)]
    assert not misses, f"tqueue.{package}'s docstring: " + "; ".join(misses)
