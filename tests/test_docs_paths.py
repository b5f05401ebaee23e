"""What the user's pages name in backticks exists: every repository path (``tqueue/...``,
``benchmarks/...``, ``native/...``, ``tests/...``, ``docs/...``), every ``python -m`` module,
every test named after a file (``path::test_name``) or alone, every ``tqueue.X.Y`` and every
``Class.member`` of the package, and every relative link. A page that names what was moved or
renamed fails here with all its misses listed at once, not one per run. docs/architecture.md,
the map of the code, is held tighter: each ``Class.member`` and ``module.function`` is looked up
in the module it lives in (the file its item names), and every package's docstring ends with a
pointer to one of its sections."""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["docs/architecture.md", "docs/performance.md", "docs/reliability.md"]

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


# docs/architecture.md is a map of the code: every name on it is resolved strictly, in the
# module it belongs to, not only somewhere in the package.
MAP = "docs/architecture.md"
_MEMBER = re.compile(r"^(_?[A-Za-z]\w*)\.(\w+)(?:\(\))?$")
_BARE_CLASS = re.compile(r"^[A-Z][a-z0-9]\w*$")
_ITEM_START = re.compile(r"^(?:#|\||\s*(?:\d+\.|\*|-)\s)")


@functools.cache
def _module_index() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(class name -> the modules defining it, module stem -> the modules of that name), over
    tqueue/, as repository paths."""
    classes: dict[str, list[str]] = {}
    stems: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tqueue").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        stems.setdefault(path.stem, []).append(rel)
        for node in ast.parse(path.read_text(), rel).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(rel)
    return classes, stems


@functools.cache
def _set_on_instances(path: str, name: str) -> frozenset[str]:
    """What the methods of class ``name`` in the file at ``path`` set on ``self``."""
    found: set[str] = set()
    for node in ast.parse((ROOT / path).read_text(), path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            for item in ast.walk(node):
                targets = item.targets if isinstance(item, ast.Assign) else \
                    [item.target] if isinstance(item, ast.AnnAssign) else []
                found |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                          and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return frozenset(found)


def _import_path(path: str) -> object:
    return importlib.import_module(path.removesuffix(".py").removesuffix("/__init__").replace("/", "."))


def _has_member(path: str, cls_name: str, member: str) -> bool:
    cls = getattr(_import_path(path), cls_name, None)
    if not isinstance(cls, type):
        return False
    if hasattr(cls, member) or member in getattr(cls, "__dataclass_fields__", {}) \
            or member in getattr(cls, "__struct_fields__", ()):
        return True
    for klass in cls.__mro__:  # an attribute only its instances have
        file = getattr(importlib.import_module(klass.__module__), "__file__", "") or ""
        if file.startswith(str(ROOT / "tqueue")) and member in _set_on_instances(
                str(pathlib.Path(file).relative_to(ROOT)), klass.__name__):
            return True
    return False


def _pick(name: str, candidates: list[str], named: set[str]) -> tuple[str | None, str]:
    """The one module among ``candidates`` that ``name`` means: the one the same item names,
    else the only one there is; or why there is none."""
    if not candidates:
        return None, "defined nowhere in tqueue/"
    on_line = [c for c in candidates if c in named]
    if len(on_line) == 1 or len(candidates) == 1:
        return (on_line or candidates)[0], ""
    return None, f"ambiguous ({', '.join(candidates)}): name its file beside it"


def _items(text: str) -> list[tuple[int, str]]:
    """The page cut into items (a heading, a table row, a list item with its continuation
    lines, a paragraph), each with the number of its first line."""
    items: list[tuple[int, list[str]]] = []
    fresh = True
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            fresh = True
            continue
        if fresh or _ITEM_START.match(line):
            items.append((line_no, []))
        items[-1][1].append(line)
        fresh = line.startswith(("#", "|"))
    return [(n, " ".join(lines)) for n, lines in items]


def _strict_misses(text: str, page: str = MAP) -> list[str]:
    """Every ``Class.member``, ``module.function``, class and file of a folder named in backticks on ``text``,
    resolved by importing the module it lives in (the one its item names, where the name is
    in several) and looking the member up: a method, a field, or an attribute its instances
    set. Each miss names the line and why."""
    classes, stems = _module_index()
    misses = []
    for line_no, item in _items(text):
        tokens = re.findall(r"`([^`]+)`", item)
        named = {p.rstrip(".") for t in tokens for p in _PATH.findall(t)}
        local = {c.name for p in named if p.endswith(".py") and not p.startswith("tqueue/") and (ROOT / p).exists()
                 for c in ast.parse((ROOT / p).read_text()).body if isinstance(c, ast.ClassDef)}
        folders = [p for p in named if p.endswith("/")]
        for token in tokens:
            where = f"{page}:{line_no}: {token}"
            if re.fullmatch(r"[\w.-]+\.py", token):  # a file of a folder its item names
                if not any((ROOT / folder / token).exists() for folder in folders):
                    misses.append(f"{where}: in none of the folders its item names ({', '.join(folders) or 'none'})")
            elif m := _MEMBER.match(token):
                owner, member = m[1], m[2]
                if owner[0].isupper():
                    if owner in local:
                        continue
                    path, why = _pick(owner, classes.get(owner, []), named)
                    if path is None:
                        misses.append(f"{where}: class {why}")
                    elif not _has_member(path, owner, member):
                        misses.append(f"{where}: {owner} in {path} has no {member}")
                elif owner in stems:
                    path, why = _pick(owner, stems[owner], named)
                    if path is None:
                        misses.append(f"{where}: module {why}")
                    elif not hasattr(_import_path(path), member):
                        misses.append(f"{where}: {path} has no {member}")
            elif _BARE_CLASS.match(token) and token not in classes and token not in local:
                misses.append(f"{where}: no class of that name in tqueue/ or the files its item names")
    return misses


def _anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if re.match(r"#+ ", line)}


def test_every_class_member_and_function_the_map_names_is_where_it_says():
    misses = _strict_misses((ROOT / MAP).read_text())
    assert not misses, f"{len(misses)} names in {MAP} that do not resolve:\n" + "\n".join(misses)


def test_the_strict_resolver_catches_a_wrong_name():
    """Each kind of miss, once; and a name real in one module but not in another."""
    text = (
        "`Writes.grant` in `tqueue/controller/parts/_writes.py`; `Writes.nope`\n\n"
        "`_partition.step_in` `_writes.nope` `_nope.x`\n\n"
        "`ControllerState.parked` (set in its constructor) `Nope.x` `Nopes`\n\n"
        "`Options.mode` with `tqueue/client/_ask.py`\n\n"
        "`Options.mode` with `tqueue/controller/model/_partition.py`\n\n"
        "`Options.mode` alone\n\n"
        "| `tqueue/controller/model/` | `_samples.py`, `_nope.py` |\n"
    )
    found = [m.split(": ", 2)[1:] for m in _strict_misses(text, "page")]
    assert found == [
        ["Writes.nope", "Writes in tqueue/controller/parts/_writes.py has no nope"],
        ["_writes.nope", "tqueue/controller/parts/_writes.py has no nope"],
        ["Nope.x", "class defined nowhere in tqueue/"],
        ["Nopes", "no class of that name in tqueue/ or the files its item names"],
        ["Options.mode", "Options in tqueue/controller/model/_partition.py has no mode"],
        ["Options.mode", "class ambiguous (tqueue/client/_ask.py, tqueue/controller/model/_partition.py): "
                          "name its file beside it"],
        ["_nope.py", "in none of the folders its item names (tqueue/controller/model/)"],
    ]


def test_links_to_the_maps_sections_lead_somewhere():
    anchors = _anchors(ROOT / MAP)
    misses = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for target in _LINK.findall(page.read_text()):
            file, _, anchor = target.partition("#")
            if anchor and (file == "architecture.md" or (not file and page.name == "architecture.md")) \
                    and anchor not in anchors:
                misses.append(f"{page.name}: ({target})")
    assert not misses, "links to sections docs/architecture.md does not have: " + "; ".join(misses)


INITS = sorted((ROOT / "tqueue").rglob("__init__.py"))


@pytest.mark.parametrize("init", INITS, ids=[str(p.parent.relative_to(ROOT)) for p in INITS])
def test_each_package_docstring_ends_pointing_at_its_section_of_the_map(init):
    """The last line of every package's docstring is ``Map: docs/architecture.md#<anchor>``,
    an anchor the page has."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    last = doc.strip().splitlines()[-1] if doc.strip() else ""
    m = re.fullmatch(r"Map: docs/architecture\.md#([\w-]+)\.?", last.strip())
    assert m, f"{init.relative_to(ROOT)}: the docstring's last line is {last!r}, not 'Map: docs/architecture.md#...'"
    assert m[1] in _anchors(ROOT / MAP), f"{init.relative_to(ROOT)}: docs/architecture.md has no section #{m[1]}"


def test_the_environment_table_lists_every_variable_the_code_reads_and_no_other():
    """docs/api.md's table of ``TQUEUE_*`` variables against those the package and the shim
    name in their source: a variable added or dropped without the table fails here."""
    import re

    code: set[str] = set()
    for root in (ROOT / "tqueue", ROOT / "compat" / "transferqueue" / "transfer_queue"):
        for path in root.rglob("*.py"):
            code |= set(re.findall(r"\bTQUEUE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    page = (ROOT / "docs" / "api.md").read_text()
    section = page.split("### Environment variables", 1)[1].split("\n## ", 1)[0]
    table = {name for line in section.splitlines() if line.startswith("| ") for name in re.findall(r"`(TQUEUE_[A-Z0-9_]+)`", line)}
    assert table == code, f"only in the code: {sorted(code - table)}; only in the table: {sorted(table - code)}"
