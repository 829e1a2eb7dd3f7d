"""The kernel layer announces its first-use work (cbgen.phases) when, and only when, it does it:
the build when it compiles (never for a library already in the cache), the tuning pass when it
measures (never when it reads its file back or the machine is busy). The compiler and the
timings are stand-ins: what is checked is what a user is told, not how long it takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from cbgen.cpu import build, tuning
from cbgen.phases import BUILD, TUNE, listening

Heard = list[tuple[str, str, "float | None"]]


@pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")
def test_the_build_is_announced_when_it_compiles_and_not_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled: list[Path] = []

    def fake_compile(cc: str, flags: object, lib_path: Path) -> None:
        compiled.append(lib_path)
        lib_path.write_bytes(b"not a library")  # loading it fails: that is after the phase

    monkeypatch.setattr(build, "_compile", fake_compile)
    heard: Heard = []
    with listening(lambda *event: heard.append(event)):
        first = build.build_library(tmp_path)
        again = build.build_library(tmp_path)
    assert len(compiled) == 1 and first.library is None and again.library is None
    target = build.probe_target(build.find_compiler() or "", tuple(build._FLAGS))
    text = f"building CPU kernels for {target.describe()}: first use, cached"
    assert [event[:2] for event in heard] == [(BUILD, text), (BUILD, text)]
    assert heard[0][2] is None and isinstance(heard[1][2], float)  # begun, then ended


def test_the_tuning_pass_is_announced_when_it_measures_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = tmp_path / "cbgen_cpu_0123456789abcdef.so"
    measured: list[str] = []

    def measure(reps: int = 5, blocked_from: int = 0) -> tuple[list[float], list[float]]:
        measured.append("small_gemm against oneDNN")
        return [1.0, 1.0], [2.0, 2.0]

    monkeypatch.setattr(tuning, "measure", measure)
    monkeypatch.setattr(tuning, "measure_blocked", lambda reps=5: None)
    heard: Heard = []
    with listening(lambda *event: heard.append(event)):
        monkeypatch.setattr(tuning, "_load_per_cpu", lambda: 0.9)
        assert tuning.tune(lib, default=7).source.startswith("build default: machine busy")
        assert heard == [] and measured == []
        monkeypatch.setattr(tuning, "_load_per_cpu", lambda: 0.0)
        assert tuning.tune(lib, default=7).source == "measured"
        assert tuning.tune(lib, default=7).source == "measured"  # read back from its file
    assert measured == ["small_gemm against oneDNN"]
    text = "tuning CPU kernels for this machine: first use, kept beside the build"
    assert [event[:2] for event in heard] == [(TUNE, text), (TUNE, text)]
