"""The import rules of docs/architecture.md, read from the source: every import of every module,
function-level ones included."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"engine": "batchtop.engine", "kernels": "batchtop.kernels", "telemetry": "batchtop.telemetry",
            "tui": "batchtop.tui"}
# Code that runs inside vLLM's engine process: batchtop.telemetry and what vLLM installs, nothing else.
VLLM_GUESTS = ("scheduler", "observer", "prefix_cache", "slots", "control", "endpoint", "harness", "check")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGES[parts[0]], *parts[1:]])


def imports_of(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (a `from X import y` counts as X and X.y)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(p): imports_of(p) for top in PACKAGES for p in sorted((ROOT / top).rglob("*.py"))}


def offending(prefix: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Modules under `prefix` that import a name under one of `forbidden` and not under `allowed`."""
    def under(name, roots):
        return any(name == root or name.startswith(root + ".") for root in roots)
    bad = {}
    for module, names in MODULES.items():
        if under(module, (prefix,)):
            hits = sorted(n for n in names if under(n, forbidden) and not under(n, allowed))
            if hits:
                bad[module] = hits
    return bad


def test_every_package_is_found():
    assert {"batchtop.engine.core.engine", "batchtop.engine.server.app", "batchtop.telemetry.events",
            "batchtop.kernels.cpu", "batchtop.tui.app", "batchtop.engine.vllm.scheduler"} <= set(MODULES)


def test_run_from_the_root_its_folders_are_not_top_level_modules():
    """From the repository root the root is on sys.path, where kernels/ is found as a top-level
    `kernels` and would shadow Hugging Face's package that transformers imports; importing the engine
    takes the root off."""
    probe = ("import importlib.util as u; before = u.find_spec('kernels'); import batchtop.engine; "
             "after = u.find_spec('kernels'); print(before and before.origin, after and after.origin)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    before, after = run.stdout.split()
    assert before == str(ROOT / "kernels" / "__init__.py")
    assert after == "None" or not Path(after).is_relative_to(ROOT / "kernels")   # or Hugging Face's


def test_engine_core_imports_neither_server_nor_benchmarks_nor_the_dashboard():
    assert offending("batchtop.engine.core", ("batchtop.engine.server", "batchtop.engine.bench",
                                              "batchtop.engine.reliability", "batchtop.engine.vllm",
                                              "batchtop.engine.whatif", "batchtop.tui", "textual", "fastapi",
                                              "uvicorn")) == {}


def test_whatif_runs_the_scheduler_without_the_engine_or_the_model():
    forbidden = ("batchtop.engine.core.engine", "batchtop.engine.core.loop", "batchtop.engine.model.loading",
                 "batchtop.engine.model.runner", "batchtop.engine.server", "batchtop.engine.bench",
                 "batchtop.tui", "torch", "transformers")
    assert offending("batchtop.engine.whatif", forbidden) == {}


def test_model_side_imports_no_engine_core():
    assert offending("batchtop.engine.model", ("batchtop.engine", "batchtop.tui", "textual"),
                     allowed=("batchtop.engine.model",)) == {}


def test_engine_never_imports_the_dashboard():
    assert offending("batchtop.engine", ("batchtop.tui", "textual")) == {}


def test_the_load_the_engine_loop_runs_is_a_leaf():
    """engine/core/loop.py reads the built-in load's arrivals; they import nothing of batchtop, so there
    is no cycle."""
    assert "batchtop.engine.workload.arrivals" in MODULES["batchtop.engine.core.loop"]
    assert offending("batchtop.engine.workload.arrivals", ("batchtop",)) == {}


@pytest.mark.parametrize("package", ["batchtop.telemetry", "batchtop.kernels"])
def test_telemetry_and_kernels_import_nothing_else_of_batchtop(package):
    assert offending(package, ("batchtop",), allowed=(package,)) == {}


def test_vllm_guest_modules_import_only_telemetry_and_what_vllm_installs():
    allowed_top = {"vllm", "torch", "fastapi", "pydantic", "uvicorn", "__future__"}
    allowed_top |= set(sys.stdlib_module_names)
    guests = {f"batchtop.engine.vllm.{name}" for name in VLLM_GUESTS}
    bad = {}
    for guest in sorted(guests):
        for name in sorted(MODULES[guest]):
            ours = name.startswith("batchtop.")
            if (ours and not (name.startswith("batchtop.telemetry") or name == "batchtop.engine.vllm"
                              or name.rsplit(".", 1)[0] in guests or name in guests)
                    or not ours and name.split(".")[0] not in allowed_top):
                bad.setdefault(guest, []).append(name)
    assert bad == {}


def test_the_rules_see_a_violation():
    """The walker resolves relative imports: a core module importing the server is caught."""
    assert "batchtop.engine.core.scheduler" in imports_of(ROOT / "engine" / "core" / "engine.py")
    MODULES["batchtop.engine.core.fake"] = {"batchtop.engine.server.app"}
    try:
        assert offending("batchtop.engine.core", ("batchtop.engine.server",)) == {
            "batchtop.engine.core.fake": ["batchtop.engine.server.app"]}
    finally:
        del MODULES["batchtop.engine.core.fake"]


# The dashboard is written against its sources: only the engine adapter, the command modules and the
# benchmark of the dashboard over the engine reach into batchtop.engine.
TUI_ENGINE_SIDE = ("batchtop.tui.sources.engine", "batchtop.tui.commands", "batchtop.tui.cli",
                   "batchtop.tui.bench", "batchtop.tui.fleet.bench")


def dashboard_modules_reaching_the_engine() -> dict[str, list[str]]:
    return {module: hits for module, hits in offending("batchtop.tui", ("batchtop.engine",)).items()
            if module not in TUI_ENGINE_SIDE}


def test_the_dashboard_imports_nothing_of_the_engine():
    assert {"batchtop.tui.dashboard", "batchtop.tui.model", "batchtop.tui.sources.remote"} <= set(MODULES)
    assert dashboard_modules_reaching_the_engine() == {}


def test_the_dashboard_rule_sees_a_violation():
    MODULES["batchtop.tui.fake_panel"] = {"batchtop.engine.core.knobs"}
    try:
        assert dashboard_modules_reaching_the_engine() == {
            "batchtop.tui.fake_panel": ["batchtop.engine.core.knobs"]}
    finally:
        del MODULES["batchtop.tui.fake_panel"]


PROTOCOL = "batchtop.telemetry.protocol"
# What only the protocol package may define: one command queue, one knob type and validator, one
# set of access rules, one server runner (a subclass of the protocol's, adding a host's state, is fine).
PROTOCOL_ONLY_CLASSES = re.compile(r".*(CommandQueue|Commands|Controls|KnobRule|KnobUpdate|BodyLimit|"
                                   r"BearerAuth|AccessRules|Guard)$|Knob$|EventRing$|ServerThread$")
PROTOCOL_ONLY_CALLS = ("queue.Queue", "queue.SimpleQueue", "uvicorn.Server", "uvicorn.Config")


def _definitions(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(base) for base in node.bases}
            yield "class", node.name, bases
        elif isinstance(node, ast.Call):
            yield "call", ast.unparse(node.func), set()


def test_the_protocol_is_a_leaf_the_vllm_guest_may_import():
    allowed_top = {"fastapi", "starlette", "pydantic", "uvicorn", "sse_starlette", "__future__"}
    allowed_top |= set(sys.stdlib_module_names)
    bad = {m: sorted(n for n in names if not n.startswith("batchtop.telemetry") and n.split(".")[0] not in
                     allowed_top) for m, names in MODULES.items() if m.startswith(PROTOCOL)}
    assert {m: n for m, n in bad.items() if n} == {}
    for guest in ("endpoint", "scheduler", "control"):
        assert any(n.startswith(PROTOCOL) for n in MODULES[f"batchtop.engine.vllm.{guest}"]), guest
    for host in ("batchtop.engine.server.app", "batchtop.engine.server.host", "batchtop.engine.core.loop"):
        assert any(n.startswith(PROTOCOL) for n in MODULES[host]), host


def test_no_second_copy_of_the_command_queue_knob_validator_rules_or_runner():
    copies = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = module_name(path)
            if module.startswith(PROTOCOL):
                continue
            for kind, name, bases in _definitions(path):
                if kind == "class" and PROTOCOL_ONLY_CLASSES.match(name) and not any(
                        base.startswith("runner.") for base in bases):
                    copies.append(f"{module}: class {name}")
                elif kind == "call" and name in PROTOCOL_ONLY_CALLS:
                    copies.append(f"{module}: {name}()")
                if kind == "class" and name.endswith("Move") and module != "batchtop.telemetry.rows":
                    copies.append(f"{module}: class {name} (a row move is telemetry.rows.RowMove)")
    assert copies == []


def test_the_copy_rule_sees_a_copy(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("import queue\nclass KnobRule: pass\nq = queue.SimpleQueue()\n")
    found = [(kind, name) for kind, name, _ in _definitions(fake)]
    assert ("class", "KnobRule") in found and PROTOCOL_ONLY_CLASSES.match("KnobRule")
    assert ("call", "queue.SimpleQueue") in found
