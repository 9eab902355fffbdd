"""The package's import graph, read from the source (every import statement, those inside functions too):
no module imports itself back through others, the packages form a DAG, ``kernels`` is a leaf (torch and Triton
only), and the model, the cache and the kernels never reach up into the engine, the ranks or the benchmark."""

from __future__ import annotations

import ast
import os

import dsv4

ROOT = os.path.dirname(os.path.abspath(dsv4.__file__))
LOWER = ("kernels", "cache", "model")  # the layers the engine is built from
UPPER = ("engine", "parallel", "bench", "llm", "cli")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = "dsv4." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: str) -> set[str]:
    """The dsv4 modules ``name`` imports (a ``from pkg import mod`` names the module, else the package)."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m == "dsv4" or m.startswith("dsv4.")}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _unit(module: str) -> str:
    """The top-level package or module of dsv4 a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dsv4"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next((w for w in it if w in graph), None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert "dsv4.cache.storage" in GRAPH["dsv4.engine.backend"]  # relative imports resolve


def test_no_module_cycles():
    assert _cycles(GRAPH) == []


def test_packages_form_a_dag():
    units: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        if _unit(m) != "dsv4":  # dsv4/__init__ re-exports the API
            units.setdefault(_unit(m), set()).update(_unit(d) for d in deps if _unit(d) != _unit(m))
    assert _cycles(units) == [], units


def test_kernels_are_a_leaf_and_lower_layers_do_not_reach_up():
    bad = [(m, d) for m, deps in GRAPH.items() if _unit(m) == "kernels" for d in deps if _unit(d) != "kernels"]
    assert bad == [], f"kernels import other dsv4 packages: {bad}"
    bad = [(m, d) for m, deps in GRAPH.items() if _unit(m) in LOWER for d in deps if _unit(d) in UPPER]
    assert bad == [], f"{LOWER} import {UPPER}: {bad}"


def test_environment_switches_live_in_env():
    """Every ``DSV4_*`` variable the package reads is registered in ``dsv4/env.py`` (its table says what it
    does): no other module holds one's name as a string literal (prose may mention them)."""
    import re

    from dsv4 import env

    seen = {}
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"DSV4_[A-Z0-9_]+", node.value):
                seen.setdefault(node.value, set()).add(m)
    assert set(seen) == set(env.ALL) and all(mods == {"dsv4.env"} for mods in seen.values()), seen
    assert all(f"``{n}" in env.__doc__ for n in env.ALL)
    mentioned = {n for path in MODULES.values() for n in re.findall(r"DSV4_[A-Z0-9_]+", open(path).read())}
    assert mentioned <= set(env.ALL), f"unregistered switches: {mentioned - set(env.ALL)}"


def test_one_kernel_dispatch_policy():
    """Every kernel-or-twin choice goes through ``kernels.on`` / ``kernels.enabled`` (one switch, which training
    turns off): no module tests ``HAVE_TRITON`` at run time, which only says whether Triton was importable."""
    import re

    for m, path in MODULES.items():
        if m == "dsv4.kernels":
            continue
        for i, line in enumerate(open(path, encoding="utf-8"), 1):
            code = line.split("#")[0]
            if "HAVE_TRITON" in code:
                assert re.match(r"\s*(from \. import HAVE_TRITON|if HAVE_TRITON:)", code), f"{m}:{i}: {line.strip()}"


def test_the_switch_turns_every_kernel_off(monkeypatch):
    import torch

    import dsv4.kernels as K

    monkeypatch.setattr(K, "_enabled", True)  # as on a GPU machine
    x = torch.zeros(2)
    assert K.enabled() and not K.on(x)  # a CPU tensor takes the twin either way
    monkeypatch.setattr(K, "HAVE_TRITON", True)
    K.set_enabled(False)
    assert not K.enabled() and not K.on(x)
    K.set_enabled(True)
    assert K.enabled()


# Kernels that read their weight before the wait under PDL RELEASE (``pdl.releasing``), and the parameter that is
# their weight: no kernel writes a weight. Their first memory access is ``enter(PDL)`` or ``load_weight_and_enter``
# (which loads before it under RELEASE), the latter only through ``w_rows``, assigned once from ``<weight> + ...``.
EARLY_WEIGHT_READS = {"_fp8_row_kernel": "W", "_row_kernel": "W", "_mix_partials": "FN", "_gate_logits": "W"}


def _reads_only_weights_before_waiting(fn: ast.FunctionDef) -> bool:
    weight = EARLY_WEIGHT_READS[fn.name]
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    weighed = [n for n in calls if ast.unparse(n.func) == "load_weight_and_enter"]
    enters = [n.lineno for n in calls if ast.unparse(n) == "enter(PDL)"] + [n.lineno for n in weighed]
    if not enters:
        return False
    early = [n for n in calls if ast.unparse(n.func) in ("tl.load", "tl.store") and n.lineno < min(enters)]
    rows = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
            and [ast.unparse(t) for t in n.targets] == ["w_rows"]]
    through_rows = [ast.unparse(n.args[0]) for n in early + weighed]
    return (all(a == "w_rows" or a.startswith("w_rows ") for a in through_rows)
            and all(ast.unparse(v).startswith(f"{weight} + ") for v in rows) and len(rows) == 1)


def test_every_kernel_launched_with_pdl_waits_first():
    """Programmatic dependent launch (``kernels.pdl``) is safe only if a kernel touches no memory before its
    wait: every kernel a launch gives ``**pdl.args()`` takes ``PDL`` and its first statement is ``enter(PDL)``
    (read from the source), but for EARLY_WEIGHT_READS, which read only their weight before it; and every kernel
    with a ``PDL`` parameter is launched that way."""
    waits, launched = {}, set()
    for m, path in MODULES.items():
        if not m.startswith("dsv4.kernels.") or m == "dsv4.kernels.pdl":
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
                waits[node.name] = (ast.unparse(body[0]) == "enter(PDL)" or node.name in EARLY_WEIGHT_READS
                                    and _reads_only_weights_before_waiting(node))
            if isinstance(node, ast.Call) and any(k.arg is None and ast.unparse(k.value) == "pdl.args()"
                                                  for k in node.keywords):
                assert isinstance(node.func, ast.Subscript), f"{m}: {ast.unparse(node.func)}"
                launched.add(ast.unparse(node.func.value))
    assert launched and set(waits) == launched, (set(waits) ^ launched)
    assert all(waits.values()), [k for k, ok in waits.items() if not ok]
