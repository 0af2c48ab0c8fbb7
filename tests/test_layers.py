"""The package's import graph, read from the source: no cycle, and no import upward between layers.

Layers, top down: cli/bench (& the `batchjob` facade) -> job -> engine -> model & kernels -> env. Lazy imports inside
functions count too. Inside job, the run's flow (job/*.py and its rooms run/ above cache/ above input/) sits above
telemetry/, which sits above output/; those two use of the flow only its leaf formats (the OpenAI Batch lines, the
exit codes). The kernels share the model's data
types (attention metadata, the fp8 format) but never its reference ops, which only the bench's kernel checks compare
them with; the model never imports the kernels (the engine hands it an ops backend)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "batchjob"
RANK = {"cli": 3, "bench": 3, "job": 2, "engine": 1, "model": 0, "kernels": 0, "env": -1}
ROOM_RANK = {"flow": 2, "telemetry": 1, "output": 0}
FLOW_RANK = {"run": 2, "cache": 1, "input": 0}
ROOMS_MAY_USE = {"batchjob.job.input.openai_batch", "batchjob.job.exit_codes"}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: a relative import; the package imports by absolute names"
                base = node.module
                # `from pkg import sub` imports the submodule pkg.sub where there is one
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "cli"  # the `batchjob` facade sits with the applications


def room(module: str) -> str:
    """A job module's room: output/, telemetry/ or the flow (the top of job/ and its run/, cache/, input/)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in ROOM_RANK else "flow"


def flow_room(module: str) -> str | None:
    """A flow module's own folder (run/, cache/ or input/), or None at the top of job/."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in FLOW_RANK else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            a, b = layer(source), layer(target)
            if RANK[b] > RANK[a]:
                wrong.append(f"{source} imports {target} ({a} is below {b})")
            elif a == "model" and b == "kernels":
                wrong.append(f"{source} imports {target} (the model takes its ops from the engine)")
            elif a == "kernels" and target == "batchjob.model.ops":
                wrong.append(f"{source} imports {target} (the reference ops are for kernels' tests only)")
            elif a == b == "job" and ROOM_RANK[room(target)] > ROOM_RANK[room(source)] and target not in ROOMS_MAY_USE:
                wrong.append(f"{source} imports {target} ({room(source)} is below {room(target)})")
            elif (
                a == b == "job"
                and (fa := flow_room(source))
                and (fb := flow_room(target))
                and FLOW_RANK[fb] > FLOW_RANK[fa]
            ):
                wrong.append(f"{source} imports {target} ({fa}/ is below {fb}/)")
    return sorted(wrong)


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_no_layer_imports_a_layer_above_it():
    graph = import_graph()
    assert {layer(m) for m in graph} == set(RANK)  # every module is in a known layer
    assert upward_imports(graph) == []


def test_the_checks_see_cycles_and_upward_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert upward_imports({"batchjob.engine.x": {"batchjob.job.y"}, "batchjob.job.y": {"batchjob.engine.x"}}) == [
        "batchjob.engine.x imports batchjob.job.y (engine is below job)"
    ]
    assert upward_imports({"batchjob.job.output.x": {"batchjob.job.spec", "batchjob.job.input.openai_batch"}}) == [
        "batchjob.job.output.x imports batchjob.job.spec (output is below flow)"
    ]
    assert upward_imports({"batchjob.job.output.x": {"batchjob.job.telemetry.y"}}) == [
        "batchjob.job.output.x imports batchjob.job.telemetry.y (output is below telemetry)"
    ]
    assert upward_imports(
        {"batchjob.job.input.x": {"batchjob.job.cache.y"}, "batchjob.job.cache.y": {"batchjob.job.run.z"}}
    ) == [
        "batchjob.job.cache.y imports batchjob.job.run.z (cache/ is below run/)",
        "batchjob.job.input.x imports batchjob.job.cache.y (input/ is below cache/)",
    ]
    graph = import_graph()  # a top-level and a lazy import, as the checks read them
    assert {"batchjob.job.run.executor", "batchjob.job.run.ray_executor"} <= graph["batchjob.job.run.runner"]
