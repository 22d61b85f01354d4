"""The shape of the residency package (issue 44, item 4): no part holds its whole.

The manager (``membackend/_residency/manager.py``) is the front; its parts (faulting, eviction, unloading, the
content tags and cache, the warm ranges and holds it hands out) work on one shared
:class:`~membackend._residency.registry.Registry` and call each other through the callables the manager hands
them when it composes them. These tests pin that: no part imports the manager (type-only imports included), no
part object references it, no part probes the session with ``getattr``, and why a full unload happens (``via``)
reaches the policy's hook as an argument, never as state kept across a call.
"""

from __future__ import annotations

import ast
import functools
import types
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from test_residency import Env, load

import membackend._residency as residency_pkg
from membackend._residency import ModelKind, ResidencyManager, ResidencyPolicy
from membackend._residency.unloading import Unloading
from membackend.types import PartialFailure

PACKAGE = Path(residency_pkg.__file__).parent
#: the front, and the package's face that re-exports it: the only modules that may import the manager
FRONT = {"manager.py", "__init__.py"}
PARTS = sorted(p for p in PACKAGE.glob("*.py") if p.name not in FRONT)


def imported_modules(tree: ast.AST) -> list[str]:
    """Every module an import anywhere in ``tree`` names -- under ``if TYPE_CHECKING:`` and inside functions
    too -- as ``.name`` for a relative import, the dotted name otherwise; ``from . import x`` gives ``.x``."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.append(base)
            if not node.module:  # from . import manager
                names += [base + a.name for a in node.names]
    return names


def names_the_manager(module: str) -> bool:
    return module.split(".")[-1] == "manager" and (module.startswith(".") or "_residency" in module)


def test_the_parts_are_the_modules_this_test_checks():
    names = {p.name for p in PARTS}
    assert {"registry.py", "faulting.py", "eviction.py", "unloading.py", "content.py", "holds.py", "warm.py",
            "slots.py", "model.py", "loads.py", "policy.py"} <= names


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.name)
def test_no_part_imports_the_manager_not_even_for_its_types(part):
    """A part that imports the manager (even under ``if TYPE_CHECKING:``) can reach into it; the front composes
    the parts, the parts never name the front."""
    tree = ast.parse(part.read_text(), str(part))
    assert [m for m in imported_modules(tree) if names_the_manager(m)] == []


def test_the_check_would_see_a_type_only_import_of_the_manager():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .manager import ResidencyManager\n")
    assert any(names_the_manager(m) for m in imported_modules(tree))
    for src in ("from . import manager", "import membackend._residency.manager",
                "from membackend._residency.manager import ResidencyManager"):
        assert any(names_the_manager(m) for m in imported_modules(ast.parse(src))), src


def session_probes(tree: ast.AST) -> list[str]:
    """Each ``getattr(...)``/``hasattr(...)`` whose object is the session (an expression naming ``session``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and "session" in ast.unparse(node.args[0]):
            found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize("module", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_the_session_is_used_through_its_public_methods_never_probed(module):
    """``Session.views``, ``inspect``, ``trim``, ``tracer`` and ``frees_by_id`` are all public: called directly,
    never looked up with ``getattr`` (a probe hides a renamed method behind a silent default)."""
    assert session_probes(ast.parse(module.read_text(), str(module))) == []


def test_the_probe_check_would_see_one():
    assert session_probes(ast.parse('views = getattr(self.registry.session, "views", None)'))


# --------------------------------------------------------------------------- no part object holds the manager


_LEAVES = (str, bytes, bytearray, int, float, bool, complex, type(None), range, memoryview, types.ModuleType, type,
           weakref.ref, weakref.ProxyType, weakref.CallableProxyType)


def path_to(start: Any, target: Any) -> list[str] | None:
    """A path of attributes, items, closure cells and bound ``__self__`` from ``start`` to ``target`` (None: none).
    It never walks into a module, a class or a function's globals: what it finds is held by the object itself."""
    seen = {id(start)}
    todo: deque[tuple[Any, list[str]]] = deque([(start, [type(start).__name__])])
    while todo:
        obj, path = todo.popleft()
        if obj is target:
            return path
        edges: list[tuple[str, Any]] = []
        if isinstance(obj, _LEAVES):
            continue
        if isinstance(obj, types.MethodType):
            edges += [("__self__", obj.__self__), ("__func__", obj.__func__)]
        elif isinstance(obj, types.FunctionType):
            edges += [(f"<cell {i}>", c.cell_contents) for i, c in enumerate(obj.__closure__ or ())
                      if c.cell_contents is not None]
            edges += [("__defaults__", obj.__defaults__), ("__kwdefaults__", obj.__kwdefaults__)]
        elif isinstance(obj, functools.partial):
            edges += [("func", obj.func), ("args", obj.args), ("keywords", obj.keywords)]
        elif isinstance(obj, weakref.WeakMethod):
            edges.append(("()", obj()))
        elif isinstance(obj, dict):
            edges += [(f"[{k!r}]", v) for k, v in list(obj.items())] + [("<key>", k) for k in list(obj)]
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            edges += [(f"[{i}]", v) for i, v in enumerate(list(obj))]
        else:
            edges += list(getattr(obj, "__dict__", {}).items())
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                        edges.append((slot, getattr(obj, slot)))
        for label, value in edges:
            if id(value) not in seen:
                seen.add(id(value))
                todo.append((value, path + [label]))
    return None


def busy_manager(env: Env) -> tuple[ResidencyManager, list[Any]]:
    """A manager that ran most of what its parts do -- owned models, faults, a warm range, a hold, a tag and a
    cached model, a full unload and reserving again -- and the objects it handed out (a warm range, a hold)."""
    policy = ResidencyManager(env.session())
    a = policy.register("a", env.size(0.2), env.device)
    policy.register("a-hook", env.size(0.05), env.device, ModelKind.HOOK_DELEGATE, owner=a)
    b = policy.register("b", env.size(0.2), env.device)
    policy.use([a])
    f = policy.fault(a, 0, env.page)
    warm = policy.warm_range(a, 0, env.page, env.device, f)
    policy.unpin(a, 0, env.page)
    load(policy, b)
    held = policy.hold(b, 0, env.page, env.device, lambda reason: None)
    assert policy.tag(a, 0, env.page, env.device, "k")
    policy.full_unload(b)
    load(policy, b)
    c = policy.register("c", env.size(0.1), env.device)
    load(policy, c)
    assert policy.tag(c, 0, env.page, env.device, "c0")
    assert policy.cache(c)
    assert warm is not None and held is not None
    return policy, [warm, held]


@pytest.mark.parametrize("target", ["host", "h200"])
def test_no_part_holds_the_manager(target):
    """Every object the manager is made of (its registry, its parts, its load book, its policy) and every one it
    hands out (warm ranges, holds) holds what it uses -- never the manager, not through a bound method or a
    closure either -- so what replaces a manager's method changes that public call only."""
    policy, handed_out = busy_manager(Env(target))
    parts = [v for k, v in vars(policy).items() if k != "session"] + [policy.policy]
    assert {type(p).__name__ for p in parts} >= {"Registry", "Eviction", "Unloading", "Contents", "Faulting",
                                                  "LoadBook", "ResidencyPolicy"}
    for obj in parts + handed_out:
        assert path_to(obj, policy) is None, f"{type(obj).__name__} reaches the manager: {path_to(obj, policy)}"


def test_the_policy_is_the_registrys_and_cannot_be_swapped_past_the_parts():
    mine = ResidencyPolicy()
    manager = ResidencyManager(Env("host").session(), policy=mine)
    assert manager.policy is mine and manager._registry.policy is mine and manager.policy_name == "membackend"
    with pytest.raises(AttributeError):
        manager.policy = ResidencyPolicy()  # the parts would go on with the old one
    assert manager.policy is mine
    manager.session.close()


def test_the_walk_would_find_a_part_that_holds_the_manager():
    policy = ResidencyManager(Env("host").session())
    sneaky = types.SimpleNamespace(cb=functools.partial(lambda: policy.models()))
    assert path_to(sneaky, policy) is not None
    assert path_to(types.SimpleNamespace(trace=policy.trace), policy) == ["SimpleNamespace", "trace", "__self__"]


# --------------------------------------------------------------------------- via: an argument of the policy's hook


class Recording(ResidencyPolicy):
    """Records each full unload the manager runs: ``(model id, via)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.inside: Any = None  # called inside the first unload_all unload (a hook that calls the manager)

    def full_unload_of(self, model, via, unload):
        self.calls.append((model.id, via))
        inside, self.inside = self.inside, None
        if inside is not None:
            inside()
        return unload(model, via)


def test_via_reaches_the_policys_hook_as_an_argument():
    env = Env("h200")
    rules = Recording()
    policy = ResidencyManager(env.session(), policy=rules)
    a = policy.register("a", env.size(0.1), env.device)
    hook = policy.register("hook", env.size(0.05), env.device, ModelKind.HOOK_DELEGATE, owner=a)
    b = policy.register("b", env.size(0.1), env.device)
    load(policy, a)
    load(policy, hook)
    policy.full_unload(a)  # the caller's own: what it owns is unloaded with it, by the same hook call
    policy.full_unload_unless_pinned(b)
    policy.unregister(b)
    policy.unload_all()
    assert rules.calls == [("a", None), ("b", None), ("b", "unregister"), ("a", "unload_all")]


def test_no_via_outlives_the_call_it_was_given_to():
    """A hook that calls the manager back (a full unload of another model, from inside unload_all's) sees that
    call's own ``via`` -- the regression kept ``via`` on the unloading part across the call into the manager."""
    env = Env("h200")
    rules = Recording()
    policy = ResidencyManager(env.session(), policy=rules)
    a, b = (policy.register(n, env.size(0.1), env.device) for n in "ab")
    rules.inside = lambda: policy.full_unload_unless_pinned(b)
    policy.unload_all()
    assert rules.calls == [("a", "unload_all"), ("b", None), ("b", "unload_all")]
    assert not hasattr(Unloading, "via") and all("via" not in vars(p) for p in vars(policy).values()
                                                   if hasattr(p, "__dict__"))


def test_what_the_hook_raises_is_what_every_unload_reports():
    """The stand-in ComfyUI's scenario injects a failure into every unload through this hook."""
    env = Env("host")

    class Failing(ResidencyPolicy):
        def full_unload_of(self, model, via, unload):
            raise RuntimeError(f"injected ({via})")

    policy = ResidencyManager(env.session(), policy=Failing())
    a = policy.register("a", env.size(0.1), env.device)
    load(policy, a)
    with pytest.raises(RuntimeError, match=r"injected \(None\)"):
        policy.full_unload(a)
    with pytest.raises(RuntimeError, match=r"injected \(None\)"):
        policy.full_unload_unless_pinned(a)
    with pytest.raises(PartialFailure, match=r"injected \(unload_all\)"):
        policy.unload_all()
    with pytest.raises(RuntimeError, match=r"injected \(unregister\)"):
        policy.unregister(a)
    assert policy.models() == [a] and policy.stats()["a"]["resident"] > 0  # nothing was unloaded


def test_the_default_hook_runs_the_managers_unload():
    seen = []

    def unload(model, via):
        seen.append((model, via))
        return 7

    assert ResidencyPolicy().full_unload_of("m", "unload_all", unload) == 7  # type: ignore[arg-type]
    assert seen == [("m", "unload_all")]


def test_no_fixture_replaces_a_managers_method_on_the_instance():
    """The stand-in's scenario reaches every unload through the policy's hook, not by replacing the manager's
    ``full_unload`` on the instance (two regressions, e5379ae and 1669816, came from that seam)."""
    fixtures = Path(__file__).parent / "fixtures"
    for path in fixtures.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    assert not (isinstance(t, ast.Attribute) and t.attr == "full_unload"), \
                        f"{path}:{node.lineno}: {ast.unparse(node)}"
