"""The invariants ARCHITECTURE.md states, as checks over the source text (``ast``; nothing is
imported, so the whole set runs in about a second).

Each check takes the package directory (``nanolight/``) and returns its violations, one
``path:line: what`` string each: `tests/test_architecture.py` runs it on the real tree, and on a
small tree written with a violation injected -- the proof that the check can fail. The checks
discover the code by walking the tree, so they keep holding while files move.
"""

from __future__ import annotations

import ast
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# Packages (and top-level modules) from the bottom up: a module imports only from lower tiers.
# Packages of one tier are siblings and import nothing from each other. checkpoint/ is below
# models/ and parallel/: it is handed a layout, and the model loads itself (models/pretrained.py). "" is nanolight/__init__.py, the public names.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("checkpoint",),
    ("models", "precision", "seed"),
    ("parallel",),
    ("data", "planner"),
    ("strategies",),
    ("module", "loggers"),
    ("callbacks",),
    ("core", "demos", "profilers", "utilities"),  # Lightning's import paths, over what they re-export
    ("trainer",),
    ("pretrain",),
    ("",),
)

OUTSIDE = ("recipes", "scripts", "tests", "conftest")  # the programs above the library

# The upward imports allowed, each under `if TYPE_CHECKING:` only: a hook's `trainer` argument
# and a module's `self.trainer` are typed, never imported at run time.
TYPE_HINT_UP: frozenset[tuple[str, str]] = frozenset({("callbacks", "trainer"), ("module", "trainer")})

# Who reads where this process sits in a launched run (ARCHITECTURE.md: only the launcher).
LAUNCH_MODULES = ("parallel/launcher.py", "parallel/environment.py")
LAUNCH_VARS = frozenset(
    (
        *("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"),
        *("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "JSM_NAMESPACE_RANK"),
        "CUDA_VISIBLE_DEVICES",
    )
)
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_")

# Who creates process groups (ARCHITECTURE.md: only ParallelContext; the launcher joins the world).
GROUP_MAKERS: dict[str, frozenset[str]] = {
    "parallel/context.py": frozenset({"new_group", "new_subgroups", "init_device_mesh", "DeviceMesh"}),
    "parallel/launcher.py": frozenset({"init_process_group"}),
    # forked measuring processes' gloo world of their own (`join_local_gloo`: the calibration's
    # all-reduce pair, the probe ranks; their tp groups are ParallelContext's), not a run's
    "planner/probes.py": frozenset({"init_process_group"}),
}
GROUP_CALLS = frozenset().union(*GROUP_MAKERS.values(), {"new_subgroups_by_enumeration"})

ATOMIC_MODULE = "checkpoint/atomic.py"  # the one place a file or directory is renamed into place
RENAMES = frozenset({("os", "replace"), ("os", "rename"), ("os", "renames"), ("shutil", "move")})


@dataclass(frozen=True)
class Module:
    """One source file of the package."""

    rel: str  # "parallel/context.py", relative to the package directory
    path: Path

    @property
    def tree(self) -> ast.Module:
        return self._parsed[0]

    @property
    def nodes(self) -> list[ast.AST]:
        """Every node of the tree (``ast.walk``'s order), walked once per version of the file."""
        return self._parsed[1]

    @property
    def _parsed(self) -> tuple[ast.Module, list[ast.AST]]:
        stat = self.path.stat()
        return _parse(self.path, stat.st_mtime_ns, stat.st_size)

    @property
    def name(self) -> str:
        """The dotted name below the package: "parallel.context", "parallel" for its __init__."""
        parts = self.rel[: -len(".py")].split("/")
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    @property
    def is_package(self) -> bool:
        return self.rel.endswith("__init__.py")

    @property
    def layer(self) -> str:
        """Its package ("parallel"), its own name for a top-level module ("errors"), "" for the root."""
        return self.name.split(".")[0]


@dataclass(frozen=True)
class Import:
    source: Module
    target: str  # a module's dotted name below the package ("checkpoint.atomic")
    line: int
    kind: str  # "run" (at import or in a function) or "type_hint" (under `if TYPE_CHECKING:`)


@lru_cache(maxsize=1024)
def _parse(path: Path, mtime_ns: int, size: int) -> tuple[ast.Module, list[ast.AST]]:
    """One parse per version of a file (the checks share it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return tree, list(ast.walk(tree))


def modules(pkg: Path) -> list[Module]:
    return [Module(p.relative_to(pkg).as_posix(), p) for p in sorted(pkg.rglob("*.py"))]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_imports(body: list[ast.stmt], kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement in `body`, nested ones included, with whether it runs."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, kind
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _walk_imports(node.body, "type_hint")
            yield from _walk_imports(node.orelse, kind)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(node, field, None) or ():
                    if isinstance(child, ast.stmt):
                        yield from _walk_imports([child], kind)
                    elif isinstance(child, (ast.excepthandler, ast.match_case)):
                        yield from _walk_imports(child.body, kind)


def imports(pkg: Path) -> list[Import]:
    """Every import of a nanolight module by a nanolight module, resolved to the module it loads."""
    mods = modules(pkg)
    names = {m.name for m in mods}
    top = pkg.name
    out = []
    for m in mods:
        for node, kind in _walk_imports(m.tree.body, "run"):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1
                    here = [top, *m.name.split(".")] if m.is_package else [top, *m.name.split(".")[:-1]]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join([*here, base] if base else here)
                wanted = [f"{base}.{a.name}" for a in node.names]  # a submodule, else a name in base
                wanted = [w if w.removeprefix(f"{top}.") in names else base for w in wanted]
            for w in wanted:
                if w != top and not w.startswith(f"{top}."):
                    continue
                target = w.removeprefix(top).removeprefix(".")
                while target and target not in names:
                    target = target.rpartition(".")[0]
                out.append(Import(m, target, node.lineno, kind))
    return out


def layer_graph(pkg: Path, kind: str = "run") -> dict[str, set[str]]:
    """Package -> the packages it imports (of one kind), for the report and the map."""
    graph: dict[str, set[str]] = {}
    for imp in imports(pkg):
        target = imp.target.split(".")[0]
        if imp.kind == kind and target != imp.source.layer:
            graph.setdefault(imp.source.layer or "nanolight", set()).add(target or "nanolight")
    return graph


def upward_imports(pkg: Path) -> list[str]:
    """Imports of a higher or sibling layer, but the type-hint ones `TYPE_HINT_UP` lists."""
    tier = {name: i for i, names in enumerate(LAYERS) for name in names}
    out = []
    for m in modules(pkg):
        if m.layer not in tier:
            out.append(f"{m.rel}: package {m.layer!r} has no place in LAYERS (tests/_architecture.py)")
        for node, _ in _walk_imports(m.tree.body, "run"):  # the library is below its programs
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if not getattr(node, "level", 0) and name.split(".")[0] in OUTSIDE:
                    out.append(f"{m.rel}:{node.lineno}: imports {name} (the library imports no program)")
    for imp in imports(pkg):
        src, dst = imp.source.layer, imp.target.split(".")[0]
        if src == dst or src not in tier or dst not in tier or tier[dst] < tier[src]:
            continue
        if imp.kind == "type_hint" and (src, dst) in TYPE_HINT_UP:
            continue
        how = "sibling" if tier[dst] == tier[src] else "higher"
        out.append(f"{imp.source.rel}:{imp.line}: {src or 'nanolight'} imports {imp.target} ({how} layer)")
    return out


def import_cycles(pkg: Path) -> list[str]:
    """Cycles among modules through imports that run (TYPE_CHECKING ones excluded), one line each.

    A module imported inside a function counts too: the cycle is there, only deferred."""
    graph: dict[str, set[str]] = {}
    for imp in imports(pkg):
        if imp.kind == "run" and imp.target != imp.source.name:
            graph.setdefault(imp.source.name, set()).add(imp.target)
    reach = {name: _reachable(graph, name) for name in graph}
    cycles = {tuple(sorted(m for m in reach[n] if n in reach.get(m, ()))) for n in graph if n in reach[n]}
    return [f"a cycle among {', '.join(members)}" for members in sorted(cycles)]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for name in graph.get(todo.pop(), ()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _is_launch_var(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value in LAUNCH_VARS or node.value.startswith(LAUNCH_PREFIXES))
    )


def launch_env_reads(pkg: Path) -> list[str]:
    """Lookups of a launch variable outside the launcher: ``env["RANK"]``, ``env.get("RANK")``,
    ``os.getenv("RANK")``, ``"RANK" in env`` (any mapping: a copy of os.environ is still it)."""
    out = []
    for m in modules(pkg):
        if m.rel in LAUNCH_MODULES:
            continue
        for node in m.nodes:
            key = None
            if isinstance(node, ast.Subscript):
                key = node.slice
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in ("get", "getenv", "pop", "setdefault", "putenv"):
                    key = node.args[0]
            elif isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops
            ):
                key = node.left
            if key is not None and _is_launch_var(key):
                out.append(
                    f"{m.rel}:{node.lineno}: reads {key.value} (only {' / '.join(LAUNCH_MODULES)} may)"
                )
    return out


def process_groups_outside_context(pkg: Path) -> list[str]:
    """Calls that create a process group or mesh anywhere `GROUP_MAKERS` does not allow them."""
    out = []
    for m in modules(pkg):
        allowed = GROUP_MAKERS.get(m.rel, frozenset())
        for node in m.nodes:
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in GROUP_CALLS and name not in allowed:
                    out.append(f"{m.rel}:{node.lineno}: {name} (process groups are ParallelContext's)")
    return out


def renames_outside_atomic(pkg: Path) -> list[str]:
    """Files or directories moved into place anywhere but ``checkpoint/atomic.py``: ``os.replace``,
    ``os.rename``, ``shutil.move`` (imported under any name), ``path.rename(x)``, ``path.replace(x)``
    (one argument: ``str.replace`` takes two, ``dataclasses.replace`` keywords)."""
    out = []
    for m in modules(pkg):
        if m.rel == ATOMIC_MODULE:
            continue
        aliases = {}  # `from os import replace as swap`
        for node in m.nodes:
            if isinstance(node, ast.ImportFrom):
                aliases |= {
                    a.asname or a.name: (node.module, a.name)
                    for a in node.names
                    if (node.module, a.name) in RENAMES
                }
        for node in m.nodes:
            if not isinstance(node, ast.Call):
                continue
            func, what = node.func, None
            if isinstance(func, ast.Name) and func.id in aliases:
                what = ".".join(aliases[func.id])
            elif isinstance(func, ast.Attribute):
                owner = func.value.id if isinstance(func.value, ast.Name) else None
                if (owner, func.attr) in RENAMES:
                    what = f"{owner}.{func.attr}"
                elif func.attr in ("rename", "replace") and len(node.args) == 1 and not node.keywords:
                    what = f"<path>.{func.attr}"
            if what:
                out.append(f"{m.rel}:{node.lineno}: {what} (atomic writes go through {ATOMIC_MODULE})")
    return out


ATTR_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_privates(m: Module) -> tuple[set[str], set[str]]:
    """The private names a file defines: its module- and class-level names (functions, classes,
    assignments) and the attributes it sets on ``self`` / ``cls``; then, apart, the attributes it
    sets on other objects (``block._hook = ...``: its own unless another file defines the name)."""
    own, elsewhere = set(), set()
    scopes = [m.tree.body]
    while scopes:
        for node in scopes.pop():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
                if isinstance(node, ast.ClassDef):
                    scopes.append(node.body)
                continue
            for sub in ast.walk(node):  # a module-level `if`/`try` block's names are the module's
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    own.add(sub.id)
    for node in m.nodes:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            (own if on_self else elsewhere).add(node.attr)
    return {n for n in own if _private(n)}, {n for n in elsewhere if _private(n)}


def private_access(pkg: Path) -> list[str]:
    """A private name another nanolight file defines, reached from outside it: ``obj._name``
    (read or set), ``getattr(obj, "_name")``, ``from nanolight.x import _name``. ``self`` / ``cls``
    / ``super()`` are the object's own (a subclass uses its base's), and so is a name this file
    defines too (``other._x`` in a class's own ``__eq__``). Private attributes of torch and other
    libraries are out of scope: only names some nanolight file defines count."""
    mods = modules(pkg)
    found = {m.rel: _defined_privates(m) for m in mods}
    owners: dict[str, set[str]] = {}
    for rel, (own, _) in found.items():
        for n in own:
            owners.setdefault(n, set()).add(rel)
    for rel, (_, elsewhere) in found.items():
        for n in elsewhere:
            if not owners.get(n, {rel}) - {rel}:  # nobody else defines it: this file's own
                owners.setdefault(n, set()).add(rel)
    defined = {rel: {n for n, files in owners.items() if rel in files} for rel in found}
    out = []
    for m in mods:
        for node in m.nodes:
            name, owner = None, None
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner, name = node.value, node.attr
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ATTR_FUNCTIONS:
                if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    owner, name = node.args[0], node.args[1].value
            elif isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").split(".")[0] == pkg.name
            ):
                for alias in node.names:
                    if _private(alias.name):
                        out.append(f"{m.rel}:{node.lineno}: imports {alias.name} from {node.module}")
                continue
            if (
                not isinstance(name, str)
                or not _private(name)
                or name in defined[m.rel]
                or name not in owners
            ):
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                continue
            out.append(
                f"{m.rel}:{node.lineno}: {ast.unparse(owner)}.{name} (defined in {', '.join(sorted(owners[name]))})"
            )
    return out


MAP_PATH = re.compile(r"`([\w./-]+\.py)`")


def unmapped_files(pkg: Path, map_text: str) -> list[str]:
    """Every non-``__init__`` file named in the map as `` `path` `` relative to the package
    (`` `parallel/context.py` ``, `` `seed.py` ``), and every ``.py`` path the map names exists
    (relative to the package, or to the repository: `` `scripts/plan.py` ``)."""
    named = set(MAP_PATH.findall(map_text))
    out = [
        f"{m.rel}: not named in the map as `{m.rel}`"
        for m in modules(pkg)
        if not m.is_package and m.rel not in named
    ]
    for path in sorted(named):
        if not (pkg / path).is_file() and not (pkg.parent / path).is_file():
            out.append(
                f"the map names `{path}`, which is not a file (a path relative to {pkg.name}/ or the repository)"
            )
    return out


def unnamed_strategy_names(pkg: Path, map_text: str) -> list[str]:
    """Every public method or property of a strategy class (a class in ``strategies/`` whose name
    ends in ``Strategy``) that the map does not name in backticks (`` `clip_gradients` ``, or
    inside one: `` `Parallel3DStrategy.from_config` ``): the seam is what the map lists."""
    words = {w for quoted in re.findall(r"`([^`\n]+)`", map_text) for w in re.findall(r"\w+", quoted)}
    out = []
    for path in sorted((pkg / "strategies").glob("*.py")):
        for cls in ast.parse(path.read_text()).body:
            if not (isinstance(cls, ast.ClassDef) and cls.name.endswith("Strategy")):
                continue
            for node in cls.body:
                public = isinstance(
                    node, ast.FunctionDef | ast.AsyncFunctionDef
                ) and not node.name.startswith("_")
                if public and node.name not in words:
                    out.append(f"strategies/{path.name}: {cls.name}.{node.name} is not named in the map")
    return out


@dataclass(frozen=True)
class SizeTargets:
    """The consolidation's targets (issue 23) that hold for good; line totals are not among them."""

    fmt_skips: int = 5
    trainer_bases: int = 2
    pipelined_in_trainer: int = 2
    file_lines: int = 460


FMT_SKIP = re.compile(r"#\s*fmt:\s*skip")


def fmt_skips(pkg: Path) -> list[str]:
    out = []
    for m in modules(pkg):
        out += [
            f"{m.rel}:{i}"
            for i, line in enumerate(m.path.read_text().splitlines(), 1)
            if FMT_SKIP.search(line)
        ]
    return out


def long_files(pkg: Path, limit: int) -> list[str]:
    lengths = {m.rel: len(m.path.read_text().splitlines()) for m in modules(pkg)}
    return [f"{rel}: {n} lines" for rel, n in lengths.items() if n > limit]


def trainer_bases(pkg: Path) -> list[str]:
    """The base classes of ``NanoTrainer`` (wherever it is defined), ``object`` left out."""
    for m in modules(pkg):
        for node in m.nodes:
            if isinstance(node, ast.ClassDef) and node.name == "NanoTrainer":
                return [ast.unparse(b) for b in node.bases if ast.unparse(b) != "object"]
    raise AssertionError(f"no class NanoTrainer under {pkg}")


def pipelined_in_trainer(pkg: Path) -> list[str]:
    """Where ``trainer/`` asks whether the strategy is pipelined (``<x>.pipelined``)."""
    out = []
    for m in modules(pkg):
        if m.layer == "trainer":
            out += [
                f"{m.rel}:{n.lineno}"
                for n in m.nodes
                if isinstance(n, ast.Attribute) and n.attr == "pipelined"
            ]
    return out


# torch.distributed's collectives and point-to-point calls: each one in nanolight has a comment saying
# who exchanges what (ARCHITECTURE.md's invariants)
COLLECTIVES = frozenset(
    {
        *("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all"),
        *("all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather"),
        *("gather_object", "scatter", "scatter_object_list", "broadcast", "broadcast_object_list"),
        *("barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv"),
    }
)
DIST_MODULES = ("torch.distributed", "torch.distributed._functional_collectives")


def _collective_name(call: ast.Call, aliases: set[str], imported: set[str]) -> str | None:
    """The collective `call` makes (``dist.all_reduce(...)``, ``torch.distributed.barrier()``, or a
    name imported from torch.distributed), else None."""
    f = call.func
    if isinstance(f, ast.Name) and f.id in imported:
        return f.id
    if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
        owner = ast.unparse(f.value)
        if owner in aliases or owner in DIST_MODULES:
            return f.attr
    return None


def _comment_lines(path: Path) -> set[int]:
    """The line numbers holding a comment (a ``#`` in a string is not one)."""
    with path.open("rb") as f:
        return {t.start[0] for t in tokenize.tokenize(f.readline) if t.type == tokenize.COMMENT}


def collectives_without_comment(pkg: Path, reach: int = 3) -> list[str]:
    """Collective calls with no comment on their lines or on the `reach` lines above them (a comment
    may open the few lines that prepare the call: the group, the op)."""
    out = []
    for m in modules(pkg):
        aliases, imported = set(), set()
        for node in m.nodes:
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name in DIST_MODULES}
            elif isinstance(node, ast.ImportFrom) and node.module in DIST_MODULES:
                imported |= {a.asname or a.name for a in node.names if a.name in COLLECTIVES}
            elif isinstance(node, ast.ImportFrom) and node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        comments = _comment_lines(m.path)
        for node in m.nodes:
            if not isinstance(node, ast.Call) or (name := _collective_name(node, aliases, imported)) is None:
                continue
            if comments.isdisjoint(range(node.lineno - reach, (node.end_lineno or node.lineno) + 1)):
                out.append(f"{m.rel}:{node.lineno}: {name} without a comment saying who exchanges what")
    return out


# The trainer's one window on the parallel core: where this process was launched (not parallel code)
TRAINER_MAY_IMPORT = ("parallel.environment",)


def parallel_code_in_trainer(pkg: Path) -> list[str]:
    """Imports in trainer/ of torch.distributed or of parallel/ beyond `TRAINER_MAY_IMPORT`."""
    out = []
    for imp in imports(pkg):
        if imp.source.layer == "trainer" and imp.target.split(".")[0] == "parallel":
            if imp.target not in TRAINER_MAY_IMPORT:
                out.append(
                    f"{imp.source.rel}:{imp.line}: imports {imp.target} (parallel code in the trainer)"
                )
    for m in modules(pkg):
        if m.layer != "trainer":
            continue
        for node in m.nodes:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                out.append(f"{m.rel}:{node.lineno}: imports torch.distributed (parallel code in the trainer)")
    return out
