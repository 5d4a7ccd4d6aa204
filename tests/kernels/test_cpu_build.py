"""The C++ kernels' build never hangs or crashes a start: CPU-keyed cache, stale locks, failures said once;
and where a compiler exists, the real build succeeds.

Each test but the last builds into its own TORCH_EXTENSIONS_DIR with torch's compiler step replaced by
a fake, so it does not touch the real extension cache (other processes may be building it).
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch.utils.cpp_extension

from batchtop.kernels import cpu


class FakeBuild:
    """Stands in for torch's `load`: checks what torch would have waited on, writes the library."""

    def __init__(self, error: Exception | None = None):
        self.calls: list[dict] = []
        self.error = error

    def __call__(self, name, sources, build_directory, **kwargs):
        lock = os.path.join(build_directory, "lock")
        assert not os.path.exists(lock), "torch would wait on this lock forever"
        self.calls.append({"name": name, "build_directory": build_directory,
                           "note": cpu.build_note()})
        if self.error is not None:
            raise self.error
        library = os.path.join(build_directory, f"{name}.so")
        if not os.path.exists(library):              # torch's ninja build is incremental too
            with open(library, "w") as out:
                out.write("fake")
        return object()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A cpu module that has not loaded yet, building into tmp_path; returns (fake, build dir)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("BATCHTOP_CPU_KERNEL", raising=False)
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_failed", None)
    monkeypatch.setattr(cpu, "_error", None)
    monkeypatch.setattr(cpu, "_building", None)
    fake = FakeBuild()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake)
    return fake, tmp_path / cpu.extension_name()


def test_cache_key_carries_the_cpu_features():
    here = cpu.cpu_features()
    assert here and cpu.extension_name() == cpu.extension_name(here)
    other = here.replace("avx2", "").replace("neon", "") + " made_up_feature"
    assert cpu.extension_name(other) != cpu.extension_name(here)
    assert cpu.extension_name().startswith(cpu.EXTENSION + "_")


def test_two_checkouts_build_into_two_folders(monkeypatch, tmp_path):
    """torch's build file names the source's path: a second checkout sharing the folder would rebuild
    the first one's library each time the two alternate."""
    here = cpu.extension_name()
    monkeypatch.setattr(cpu, "SOURCE", tmp_path / "other-checkout" / cpu.SOURCE.name)
    assert cpu.extension_name() != here


def test_first_build_is_named_while_it_runs_and_marks_the_features(fresh, capsys):
    fake, build_dir = fresh
    assert cpu.available()
    assert fake.calls[0]["name"] == cpu.extension_name()
    assert "compiling the C++ CPU kernels" in fake.calls[0]["note"]
    assert cpu.build_note() is None                      # said only while it ran
    assert (build_dir / cpu.FEATURES_FILE).read_text().strip() == cpu.cpu_features()
    assert "compiling the C++ CPU kernels" in capsys.readouterr().err


def test_cached_build_loads_without_a_note(fresh, capsys):
    fake, build_dir = fresh
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / f"{cpu.extension_name()}.so").write_text("built before")
    (build_dir / cpu.FEATURES_FILE).write_text(cpu.cpu_features())
    assert cpu.available()
    assert fake.calls[0]["note"] is None
    assert capsys.readouterr().err == ""
    assert (build_dir / f"{cpu.extension_name()}.so").read_text() == "built before"


def test_entry_marked_for_other_features_is_rebuilt_not_loaded(fresh, capsys):
    fake, build_dir = fresh
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{cpu.extension_name()}.so"
    library.write_text("built for another CPU")
    (build_dir / "cpu_kernels.o").write_text("object for another CPU")
    (build_dir / cpu.FEATURES_FILE).write_text("x86_64 avx512_made_up")
    assert cpu.available()
    assert library.read_text() == "fake"                 # rebuilt; the foreign one was deleted first
    assert not (build_dir / "cpu_kernels.o").exists()
    assert "compiling" in fake.calls[0]["note"]
    assert (build_dir / cpu.FEATURES_FILE).read_text().strip() == cpu.cpu_features()
    assert "built for other CPU features" in capsys.readouterr().err


def test_stale_lock_is_broken_with_a_message(fresh, capsys):
    fake, build_dir = fresh
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    lock.write_text("")
    old = time.time() - cpu.STALE_LOCK_S - 60
    for path in (lock, build_dir):
        os.utime(path, (old, old))
    started = time.monotonic()
    assert cpu.available()
    assert time.monotonic() - started < 5
    assert not lock.exists() and len(fake.calls) == 1
    assert "breaking the stale build lock" in capsys.readouterr().err


def test_fresh_lock_waits_for_the_other_build_and_says_so(fresh, monkeypatch, capsys):
    fake, build_dir = fresh
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    lock.write_text("")
    notes = []

    def other_build_finishes():
        time.sleep(0.3)
        notes.append(cpu.build_note())
        (build_dir / f"{cpu.extension_name()}.so").write_text("built by the other process")
        lock.unlink()
    threading.Thread(target=other_build_finishes).start()
    monkeypatch.setattr(cpu, "LOCK_POLL_S", 0.05)
    assert cpu.available()
    assert "waiting for another process's build" in notes[0]
    assert fake.calls[0]["note"] is None                 # the other process built it: nothing to compile
    assert "waiting for another process's build" in capsys.readouterr().err


def test_failed_build_is_said_once_and_torch_serves(fresh, monkeypatch, capsys):
    fake, _ = fresh
    fake.error = RuntimeError("Error building extension 'batchtop_cpu_kernels'\nlong compiler output")
    assert not cpu.available()
    assert not cpu.available()
    assert len(fake.calls) == 1                          # no second attempt
    err = capsys.readouterr().err
    assert err.count("C++ CPU kernels are unavailable") == 1
    assert "RuntimeError: Error building extension" in err and "long compiler output" not in err
    assert "torch's operators instead" in err
    assert cpu.unavailable_reason().startswith("RuntimeError: Error building extension")
    monkeypatch.setenv("BATCHTOP_CPU_KERNEL", "0")
    assert cpu.unavailable_reason() == "BATCHTOP_CPU_KERNEL=0"


def test_engine_and_header_say_why_when_the_kernels_are_off(fresh, capsys):
    from batchtop.engine.core.config import EngineConfig
    from batchtop.engine.core.engine import Engine
    from batchtop.engine.core.loop import EngineLoop
    from batchtop.telemetry.bus import EventBus
    from batchtop.tui.sources.engine import EngineSource
    fake, _ = fresh
    fake.error = OSError("no C++ compiler found")
    engine = Engine(EngineConfig(model="tiny", num_kv_blocks=16, max_model_len=128))
    assert engine.kernels_off == "OSError: no C++ compiler found"
    assert engine.generate([[1, 2, 3]])[0].finish_reason in ("stop", "length")
    source = EngineSource(EngineLoop(engine), EventBus())
    assert source.meta["kernels"] == ("C++ kernels off (OSError: no C++ compiler found): "
                                      "torch ops serve, slower")
    assert capsys.readouterr().err.count("unavailable") == 1


def test_a_failed_build_keeps_the_compilers_messages(fresh):
    fake, _ = fresh
    fake.error = RuntimeError("Error building extension 'batchtop_cpu_kernels'\n"
                              "[1/2] c++ -c cpu_kernels.cpp\n"
                              "cpu_kernels.cpp:12:5: error: 'foo' was not declared in this scope\n"
                              "ninja: build stopped: subcommand failed.")
    assert not cpu.available()
    assert cpu.build_error() == ("Error building extension 'batchtop_cpu_kernels'\n"
                                 "cpu_kernels.cpp:12:5: error: 'foo' was not declared in this scope")


def test_without_a_compiler_no_build_can_succeed_and_that_is_the_reason(monkeypatch):
    monkeypatch.delenv("BATCHTOP_CPU_KERNEL", raising=False)
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert cpu.unbuildable_reason() == "no C++ compiler (no-such-compiler-here is not on PATH)"
    monkeypatch.setenv("BATCHTOP_CPU_KERNEL", "0")
    assert cpu.unbuildable_reason() == "BATCHTOP_CPU_KERNEL=0"


@pytest.mark.skipif(cpu.unbuildable_reason() is not None,
                    reason=f"the C++ kernels cannot be built here: {cpu.unbuildable_reason()}")
def test_the_real_build_succeeds_where_a_compiler_exists():
    """Not a skip: with a compiler at hand, a kernel source that stops compiling fails the run here."""
    assert cpu.available(), (f"the C++ CPU kernels did not build ({cpu.unavailable_reason()}); the "
                             f"compiler said:\n{cpu.build_error()}")
