"""Reliability of what leanstep reads and writes on a user's say-so: paths that are not files, outputs that fail.

Two classes of defect, one catalogue each way:

- inputs that are not regular files (a FIFO, a folder holding one, ``/dev/zero``, a socket, a
  symlink loop, a file over the size limit): a clear one-line error naming the flag and path,
  never a hang (every case runs under a deadline) or a MemoryError;
- outputs that cannot be written (``--json`` under a file, a full disk, a read-only run
  directory): refused before the work when that can be known, and otherwise the work is kept
  (printed) and one line says what was not written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import stat
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from helpers.metrics_lines import PNG_SIGNATURE, train_line, write
from leanstep.bench import runner
from leanstep.cli.main import main
from leanstep.common import files, outputs
from leanstep.training import analysis, curves, data
from leanstep.training.curves import plot_curves, report
from leanstep.training.data import load_corpus
from leanstep.training.metrics_log import read_metrics
from test_reliability_input import Case

DEADLINE_S = 20


@contextlib.contextmanager
def deadline(seconds: int = DEADLINE_S) -> Iterator[None]:
    """Fails (TimeoutError) a block that blocks: a FIFO opened for reading waits forever for a writer."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s: a blocking open or an endless read")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _with(module: Any, name: str, value: Any, call: Any, *args: Any) -> Any:
    with mock.patch.object(module, name, value):
        return call(*args)


def _t(data_path: str) -> tuple[str, ...]:
    return (
        "train",
        "--model",
        "mlp",
        "--size",
        "tiny",
        "--steps",
        "1",
        "--no-progress",
        "--no-chart",
        "--data",
        data_path,
        "--out",
        "{tmp}/never-written",
    )


PLAN = ("plan", "--budget", "1GiB", "--model", "mlp", "--size", "tiny")
BENCH = ("bench", "--quick", "--quiet")
EXPECTED = "expected a text file or a folder of text files"

API = [
    Case(
        "files/limit_negative",
        lambda p: files.read_regular_file(p["regular_file"], what="x", limit=-1),
        ValueError,
        "limit must be an int >= 0 (bytes); got -1",
    ),
    Case(
        "files/over_the_limit",
        lambda p: files.read_regular_file(p["regular_file"], what="the file", limit=0),
        ValueError,
        "the file is 1 B (1 bytes), over the limit of 0 B (0 bytes)",
    ),
    Case(
        "files/output_empty",
        lambda p: outputs.check_output_path("", what="--json"),
        ValueError,
        "--json must be a non-empty file path, got ''",
    ),
    Case(
        "files/fifo_named_directly",
        lambda p: files.read_regular_file(p["fifo"], what="'f'", limit=10),
        ValueError,
        "'f' is a FIFO (named pipe), not a regular file",
    ),
    Case(
        "data/file_over_the_corpus_limit",
        lambda p: _with(data, "MAX_CORPUS_BYTES", 100, load_corpus, p["big_file"]),
        ValueError,
        "--data file '{big_file}' is 1.2 KiB (1,200 bytes), over the limit of 100 B (100 bytes)",
    ),
    Case(
        "data/folder_over_the_corpus_limit",
        lambda p: _with(data, "MAX_CORPUS_BYTES", 1000, load_corpus, p["corpus"]),
        ValueError,
        "--data folder '{corpus}' holds more than 1000 B (1,000 bytes) in regular files, the limit",
    ),
    Case(
        "data/folder_over_the_entry_limit",
        lambda p: _with(data, "MAX_CORPUS_ENTRIES", 2, load_corpus, p["corpus"]),
        ValueError,
        "--data folder '{corpus}' holds more than 2 entries, the limit",
    ),
    Case(
        "data/fifo_api",
        lambda p: load_corpus(p["fifo"]),
        ValueError,
        f"--data file '{{fifo}}' is a FIFO (named pipe), not a regular file; {EXPECTED}",
    ),
    Case(
        "report/config_over_the_limit_api",
        lambda p: _with(curves, "MAX_CONFIG_BYTES", 10, report, p["big_config_run"]),
        ValueError,
        "{big_config_run}/config.json is 25 B (25 bytes), over the limit of 10 B (10 bytes)",
    ),
]

CLI = [
    # --data that is not a regular file, or a folder of such things
    Case("train/data_fifo", _t("{fifo}"), 2, "--data file '{fifo}' is a FIFO (named pipe), not a regular file"),
    Case(
        "train/data_folder_of_a_fifo",
        _t("{fifo_dir}"),
        2,
        "--data folder '{fifo_dir}' holds no readable, non-empty text file (skipped: 1 FIFO (named pipe))",
    ),
    Case("train/data_symlink_loop", _t("{loop}"), 2, "--data path '{loop}' is a symlink loop"),
    Case("train/data_under_a_symlink_loop", _t("{loop}/x"), 2, "--data path '{loop}/x' is a symlink loop"),
    Case(
        "train/data_folder_of_a_loop",
        _t("{loop_dir}"),
        2,
        "--data folder '{loop_dir}' holds no readable, non-empty text file (skipped: 1 symlink loop)",
    ),
    Case("train/data_dev_zero", _t("/dev/zero"), 2, "--data file '/dev/zero' is a character device, not a regular"),
    Case("train/data_dev_null", _t("/dev/null"), 2, "--data file '/dev/null' is a character device, not a regular"),
    Case("train/data_socket", _t("{sock}"), 2, "--data file '{sock}' is a socket, not a regular file"),
    Case(
        "train/data_folder_of_a_socket",
        _t("{sock_dir}"),
        2,
        "holds no readable, non-empty text file (skipped: 1 socket)",
    ),
    Case(
        "train/data_folder_of_devices",
        _t("{device_dir}"),
        2,
        "--data folder '{device_dir}' holds no readable, non-empty text file (skipped: 2 x character device)",
    ),
    Case("train/data_folder_of_broken_links", _t("{broken_dir}"), 2, "(skipped: 1 broken symbolic link)"),
    Case("train/data_under_a_file", _t("{regular_file}/x"), 2, "--data path '{regular_file}/x' does not exist"),
    Case("train/data_tilde_fifo", _t("~/pipe"), 2, "--data file '{home}/pipe' is a FIFO (named pipe)"),
    Case("train/data_tilde_missing", _t("~/no-such-data"), 2, "--data path '{home}/no-such-data' does not exist"),
    # leanstep report: run files that are not regular files; --chart
    Case(
        "report/metrics_fifo",
        ("report", "{fifo_metrics_run}"),
        2,
        "{fifo_metrics_run}/metrics.jsonl is a FIFO (named pipe), not a regular file",
    ),
    Case(
        "report/metrics_symlink_loop",
        ("report", "{loop_metrics_run}"),
        2,
        "{loop_metrics_run}/metrics.jsonl is a symlink loop",
    ),
    Case(
        "report/metrics_a_directory",
        ("report", "{dir_metrics_run}"),
        2,
        "{dir_metrics_run}/metrics.jsonl is a directory, not a regular file",
    ),
    Case(
        "report/config_fifo",
        ("report", "{fifo_config_run}"),
        2,
        "{fifo_config_run}/config.json is a FIFO (named pipe), not a regular file",
    ),
    Case(
        "report/config_dev_zero",
        ("report", "{zero_config_run}"),
        2,
        "{zero_config_run}/config.json is a character device, not a regular file",
    ),
    Case(
        "report/config_symlink_loop",
        ("report", "{loop_config_run}"),
        2,
        "{loop_config_run}/config.json is a symlink loop",
    ),
    Case(
        "report/config_sparse_huge",
        ("report", "{huge_config_run}"),
        2,
        "{huge_config_run}/config.json is 65.0 MiB (68,157,440 bytes), over the limit of 64.0 MiB",
    ),
    Case(
        "report/config_not_utf8",
        ("report", "{latin1_config_run}"),
        2,
        "{latin1_config_run}/config.json is not valid JSON",
    ),
    Case("report/run_dir_symlink_loop", ("report", "{loop}"), 2, "run directory '{loop}' is a symlink loop"),
    Case("report/tilde_missing", ("report", "~/no-such-run"), 2, "run directory not found: {home}/no-such-run"),
    Case(
        "report/chart_under_a_file",
        ("report", "{ok_run}", "--chart", "{regular_file}/c.png"),
        2,
        "--chart '{regular_file}/c.png' cannot be created: '{regular_file}' is not a directory",
    ),
    Case(
        "report/chart_a_directory",
        ("report", "{ok_run}", "--chart", "{empty_dir}"),
        2,
        "--chart '{empty_dir}' is a directory; expected a file path",
    ),
    # leanstep bench: outputs checked before a minute of benchmarking
    Case(
        "bench/json_under_a_file",
        (*BENCH, "--json", "{regular_file}/b.json"),
        2,
        "--json '{regular_file}/b.json' cannot be created: '{regular_file}' is not a directory",
    ),
    Case(
        "bench/json_deep_under_a_file",
        (*BENCH, "--json", "{regular_file}/x/y/b.json"),
        2,
        "cannot be created: '{regular_file}' is not a directory",
    ),
    Case(
        "bench/json_a_directory",
        (*BENCH, "--json", "{empty_dir}"),
        2,
        "--json '{empty_dir}' is a directory; expected a file path",
    ),
    Case("bench/json_symlink_loop", (*BENCH, "--json", "{loop}"), 2, "--json '{loop}' is a symlink loop"),
    Case("bench/json_empty", (*BENCH, "--json", ""), 2, "--json must be a non-empty file path, got ''"),
    Case(
        "bench/json_tilde_under_a_file",
        (*BENCH, "--json", "~/file/b.json"),
        2,
        "--json '{home}/file/b.json' cannot be created: '{home}/file' is not a directory",
    ),
    Case(
        "bench/chart_under_a_file",
        (*BENCH, "--chart", "{regular_file}/b.png"),
        2,
        "--chart '{regular_file}/b.png' cannot be created: '{regular_file}' is not a directory",
    ),
    Case("bench/chart_a_directory", (*BENCH, "--chart", "{empty_dir}"), 2, "--chart '{empty_dir}' is a directory"),
    # leanstep plan: --json checked before planning
    Case(
        "plan/json_under_a_file",
        (*PLAN, "--json", "{regular_file}/p.json"),
        2,
        "--json '{regular_file}/p.json' cannot be created: '{regular_file}' is not a directory",
    ),
    Case("plan/json_a_directory", (*PLAN, "--json", "{empty_dir}"), 2, "--json '{empty_dir}' is a directory"),
    Case(
        "plan/json_tilde_under_a_file",
        (*PLAN, "--json", "~/file/p.json"),
        2,
        "--json '{home}/file/p.json' cannot be created: '{home}/file' is not a directory",
    ),
]

CASES = API + CLI


# --- the paths the cases point at ---------------------------------------------------------------


def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))  # the socket file outlives the socket


def _run(root: Path, name: str, **run_files: Any) -> Path:
    """A run directory with a valid metrics.jsonl unless ``run_files`` says otherwise (a callable makes the entry)."""
    run = root / name
    run.mkdir()
    entries = {"metrics.jsonl": lambda path: write(path, [train_line(s) for s in (1, 2, 3)]), **run_files}
    for entry, make in entries.items():
        make(run / entry)
    return run


def _sparse(path: Path) -> None:
    """65 MiB that take no disk space."""
    path.touch()
    os.truncate(path, 65 << 20)


def _loop(path: Path) -> None:
    os.symlink(path.name + ".other", path)
    os.symlink(path.name, path.with_name(path.name + ".other"))


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs")
    p: dict[str, Path] = {"tmp": root}
    for name in ("fifo_dir", "loop_dir", "sock_dir", "device_dir", "broken_dir", "empty_dir", "home", "corpus"):
        p[name] = root / name
        p[name].mkdir()
    os.mkfifo(root / "fifo")
    os.mkfifo(p["fifo_dir"] / "only.txt")
    os.mkfifo(p["home"] / "pipe")
    _loop(root / "loop")
    os.symlink("a.txt", p["loop_dir"] / "a.txt")  # a loop of one
    _socket(root / "sock")
    _socket(p["sock_dir"] / "s.txt")
    os.symlink("/dev/zero", p["device_dir"] / "zero.txt")
    os.symlink("/dev/null", p["device_dir"] / "null.txt")
    os.symlink("nowhere", p["broken_dir"] / "gone.txt")
    (p["home"] / "file").write_text("x")
    for i in range(3):
        (p["corpus"] / f"{i}.txt").write_text("some text to train on, long enough for a part\n" * 10)
    p["regular_file"] = root / "regular_file"
    p["regular_file"].write_text("x")
    p["big_file"] = root / "big.txt"
    p["big_file"].write_text("y" * 1200)
    p["fifo"], p["loop"], p["sock"] = root / "fifo", root / "loop", root / "sock"
    runs = {
        "ok_run": {},
        "fifo_metrics_run": {"metrics.jsonl": os.mkfifo},
        "loop_metrics_run": {"metrics.jsonl": _loop},
        "dir_metrics_run": {"metrics.jsonl": Path.mkdir},
        "fifo_config_run": {"config.json": os.mkfifo},
        "zero_config_run": {"config.json": lambda path: os.symlink("/dev/zero", path)},
        "loop_config_run": {"config.json": _loop},
        "huge_config_run": {"config.json": _sparse},
        "latin1_config_run": {"config.json": lambda path: path.write_bytes(b'{"max_grad_norm": "\xe9"}')},
        "big_config_run": {"config.json": lambda path: path.write_text('{"max_grad_norm": 1.0000}')},
    }
    for name, entries in runs.items():
        p[name] = _run(root, name, **entries)
    return p


@pytest.fixture
def no_work(monkeypatch, paths):
    """The benchmark and the planner fail loudly if reached: these cases must stop before the work."""

    def reached(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the work ran, though its output path was bad")

    monkeypatch.setattr(runner, "run_benchmark", reached)
    monkeypatch.setattr(analysis, "plan_run", reached)
    monkeypatch.setenv("HOME", str(paths["home"]))


def _fill(text: str, paths: dict[str, Path]) -> str:
    return text.format(**{k: str(v) for k, v in paths.items()})


def test_the_catalogue_is_big_and_its_ids_unique():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_a_path_that_is_not_a_file_or_cannot_be_written_gets_one_clear_line(case, paths, no_work, capsys):
    fragment = _fill(case.fragment, paths)
    if isinstance(case.call, tuple):
        argv = [_fill(a, paths) for a in case.call]
        with deadline():
            code = main(argv)
        captured = capsys.readouterr()
        assert (code, captured.out) == (case.expected, "")
        assert captured.err.count("\n") == 1 and captured.err.startswith("leanstep"), captured.err
        assert fragment in captured.err, captured.err
        assert not (paths["tmp"] / "never-written").exists()  # a run that never started wrote nothing
    else:
        with deadline(), pytest.raises(case.expected) as info:
            case.call(paths)
        assert fragment in str(info.value)
        assert "/leanstep/" in traceback.extract_tb(info.tb)[-1].filename


# --- reading: what a folder's walk skips, and what a stat cannot see -------------------------------


def test_a_folder_with_pipes_sockets_devices_and_loops_loads_its_text_and_counts_the_rest(tmp_path):
    for name in ("a.txt", "sub/b.txt", "sub/deeper/c.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"text of {name} " * 20)
    os.mkfifo(tmp_path / "pipe.txt")
    os.mkfifo(tmp_path / "sub" / "pipe2.txt")
    _socket(tmp_path / "sock.txt")
    os.symlink("/dev/zero", tmp_path / "zero.txt")
    os.symlink("loop.txt", tmp_path / "loop.txt")
    os.symlink("missing", tmp_path / "broken.txt")
    os.symlink(tmp_path, tmp_path / "sub" / "back")  # a folder link back to the top: not followed
    os.symlink(tmp_path / "a.txt", tmp_path / "sub" / "linked.txt")  # a link to a file: read
    with deadline():
        corpus = load_corpus(tmp_path)
    assert sorted(corpus.train_files + corpus.heldout_files) == [
        "a.txt",
        "sub/b.txt",
        "sub/deeper/c.txt",
        "sub/linked.txt",
    ]
    expected = {
        "a FIFO (named pipe)": 2,
        "a socket": 1,
        "a character device": 1,
        "a symlink loop": 1,
        "a broken symbolic link": 1,
        "a symlinked folder (not followed)": 1,
    }
    assert corpus.skipped == expected and corpus.describe()["skipped_entries"] == dict(sorted(expected.items()))


def test_a_file_has_no_skipped_entries_in_its_description(paths):
    assert "skipped_entries" not in load_corpus(paths["big_file"]).describe()


def test_a_fifo_swapped_in_after_the_stat_is_refused_without_blocking(paths, monkeypatch):
    real_stat = os.stat
    as_if_regular = real_stat(paths["regular_file"])
    monkeypatch.setattr(
        os, "stat", lambda path, *a, **k: as_if_regular if Path(path) == paths["fifo"] else real_stat(path, *a, **k)
    )
    with deadline(), pytest.raises(ValueError, match=r"is a FIFO \(named pipe\), not a regular file"):
        files.read_regular_file(paths["fifo"], what="'swapped'", limit=100)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_file_whose_size_the_kernel_does_not_report_is_still_read_within_the_limit():
    assert os.stat("/proc/self/status").st_size == 0  # the stat says nothing: the read must count
    with pytest.raises(ValueError, match=r"'status' holds more than 10 B \(10 bytes\), the limit"):
        files.read_regular_file("/proc/self/status", what="'status'", limit=10)
    assert b"Name:" in files.read_regular_file("/proc/self/status", what="'status'", limit=1 << 20)


# --- writing: atomic, named, and never losing the work --------------------------------------------


@pytest.mark.parametrize("failing", ["write", "fsync", "replace"])
def test_a_full_disk_while_writing_curves_png_leaves_no_partial_file_and_names_the_path(tmp_path, monkeypatch, failing):
    metrics = read_metrics(write(tmp_path / "metrics.jsonl", [train_line(s) for s in (1, 2, 3)]))
    chart = tmp_path / "curves.png"
    chart.write_bytes(b"the chart of last time")
    real_write = os.write

    def half_then_full(fd: int, data: Any) -> int:  # a short write, then the disk is full
        if len(data) > 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, failing, half_then_full if failing == "write" else full)
    with pytest.raises(OSError) as info:
        plot_curves(metrics, chart)
    monkeypatch.undo()
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, str(chart))
    assert chart.read_bytes() == b"the chart of last time"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]
    assert plot_curves(metrics, chart).read_bytes()[:8] == PNG_SIGNATURE  # and with room, it is written


def test_report_on_a_full_disk_returns_the_summary_and_the_reason(paths, monkeypatch):
    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    summary = report(paths["ok_run"], chart=paths["tmp"] / "report-full.png")
    assert summary["steps"] == 3 and summary["curves"] is None
    assert (
        summary["curves_error"] == f"cannot write the chart '{paths['tmp'] / 'report-full.png'}': "
        "No space left on device"
    )
    assert not (paths["tmp"] / "report-full.png").exists()


@contextlib.contextmanager
def read_only(folder: Path, monkeypatch: Any) -> Iterator[None]:
    """``folder`` read-only; as root (who writes anywhere) creating files in it is refused as it would be."""
    folder.chmod(0o555)
    if os.geteuid() == 0:
        real_open = os.open

        def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & os.O_CREAT and Path(os.fsdecode(path)).parent == folder:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)
    try:
        yield
    finally:
        monkeypatch.undo()
        folder.chmod(0o755)


def test_report_on_a_read_only_run_prints_the_table_and_one_line_and_exits_1(tmp_path, monkeypatch, capsys):
    run = _run(tmp_path, "ro_run", **{"config.json": lambda path: path.write_text('{"max_grad_norm": 1.0}')})
    with read_only(run, monkeypatch), deadline():
        code = main(["report", str(run)])
    captured = capsys.readouterr()
    assert code == 1
    assert "run ro_run" in captured.out and "max_grad_norm (config)" in captured.out
    assert captured.err == (
        f"leanstep report: error: cannot write the chart '{run / 'curves.png'}': Permission "
        "denied (the summary above is complete; pass --chart FILE to draw it elsewhere)\n"
    )
    assert sorted(path.name for path in run.iterdir()) == ["config.json", "metrics.jsonl"]
    with read_only(run, monkeypatch):  # the way out the line suggests
        assert main(["report", str(run), "--chart", str(tmp_path / "elsewhere" / "c.png")]) == 0
    assert (tmp_path / "elsewhere" / "c.png").read_bytes()[:8] == PNG_SIGNATURE
    assert capsys.readouterr().out.splitlines()[-1] == f"chart: {tmp_path / 'elsewhere' / 'c.png'}"


def test_report_prints_paths_with_brackets_as_they_are(tmp_path, capsys):
    (tmp_path / "a[").mkdir()
    run = _run(tmp_path / "a[", "lr]")  # the curves row shows .../a[/lr]/curves.png: a closing tag to rich
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "run lr]" in out and out.splitlines()[-1] == f"chart: {run / 'curves.png'}"


_RESULT = {
    "rows": [],
    "ratios": {"x [/b]": 1.0},
    "peak_gflops": {},
    "matmul": {},
    "mfu": {},
    "checks": {},
    "notes": ["a note [/b]"],
    "machine": {"cpu_model": "cpu [/b]", "cores_available": 2},
}


def _full_disk(path: Any, data: bytes) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))


def test_bench_keeps_its_results_when_the_json_cannot_be_written_at_the_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_benchmark", lambda config, log: json.loads(json.dumps(_RESULT)))
    monkeypatch.setattr(outputs, "write_bytes_atomic", _full_disk)
    target = tmp_path / "b.json"
    assert main([*BENCH, "--chart", "none", "--json", str(target)]) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        f"leanstep bench: error: could not write --json '{target}' (No space left on device); "
        "the table and the JSON are printed on stdout\n"
    )
    printed = json.loads(captured.out[captured.out.index('{\n  "rows"') :])
    assert printed["ratios"] == {"x [/b]": 1.0} and "cpu [/b]" in captured.out and not target.exists()


def test_bench_logs_paths_with_brackets_as_they_are(tmp_path, monkeypatch, capsys):
    def benchmark(config: Any, log: Any) -> dict:
        log("measuring [/b] things")
        return json.loads(json.dumps(_RESULT))

    monkeypatch.setattr(runner, "run_benchmark", benchmark)
    target = tmp_path / "o[" / "b]" / "b.json"
    assert main(["bench", "--quick", "--chart", "none", "--json", str(target)]) == 0
    err = capsys.readouterr().err
    assert "measuring [/b] things" in err and f"JSON written to {target}" in err.replace("\n", "")
    assert json.loads(target.read_text())["notes"] == ["a note [/b]"]


def test_plan_keeps_its_plan_when_the_json_cannot_be_written_at_the_end(tmp_path, monkeypatch, capsys):
    setting = types.SimpleNamespace(describe=lambda: "--microbatches 1 --remat none")
    result = types.SimpleNamespace(
        candidates=[],
        chosen=types.SimpleNamespace(setting=setting),
        seconds=0.5,
        compiles=0,
        compile_seconds=0.0,
        notes=(),
        to_json=lambda: {"chosen": {"remat": "none"}},
    )
    monkeypatch.setattr(analysis, "plan_run", lambda *args, **kwargs: result)
    monkeypatch.setattr(outputs, "write_bytes_atomic", _full_disk)
    target = tmp_path / "new" / "p.json"
    assert main([*PLAN, "--json", str(target)]) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        f"leanstep plan: error: could not write --json '{target}' (No space left on device); "
        "the plan is printed on stdout as JSON\n"
    )
    assert "chosen: --microbatches 1 --remat none" in captured.out
    assert json.loads(captured.out[captured.out.index("{") :]) == {"chosen": {"remat": "none"}}


def test_writing_to_a_pipe_writes_in_place_and_keeps_the_pipe(tmp_path):
    os.mkfifo(tmp_path / "out")
    reader = os.open(tmp_path / "out", os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the writer's open returns
    try:
        with deadline():
            outputs.write_bytes_atomic(tmp_path / "out", b"results\n")
        assert os.read(reader, 100) == b"results\n"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(tmp_path / "out").st_mode) and sorted(os.listdir(tmp_path)) == ["out"]


def test_check_output_path_accepts_what_can_be_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "old.json").write_text("{}")
    assert outputs.check_output_path("~/new/deeper/x.json", what="--json") == tmp_path / "new" / "deeper" / "x.json"
    assert outputs.check_output_path(tmp_path / "old.json", what="--json") == tmp_path / "old.json"
    assert outputs.check_output_path("/dev/stdout", what="--json") == Path("/dev/stdout")
    assert sorted(os.listdir(tmp_path)) == ["old.json"]  # checking creates nothing
