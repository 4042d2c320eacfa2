"""The run sized for its machine (``leanstep.training.machine_size``) and the installed-Python corpus
(``--data @python``), checked against hand computations and the files on disk."""

from __future__ import annotations

import hashlib
import json
import math
import re
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from leanstep.training import RunConfig, installed_corpus
from leanstep.training import data as data_module
from leanstep.training.data import load_corpus
from leanstep.training.machine_size import activation_bytes, size_for_machine

V5E_MEMORY = int(15.75 * 2**30)  # the TPU v5e's memory as JAX reports it (15.75 GiB)


def test_the_rule_on_a_tpu_v5e_by_hand():
    sized = size_for_machine("tpu", "TPU v5 lite", V5E_MEMORY, 180.0)
    # By hand: C = 180 s * 197e12 * 0.2; N = sqrt(C / 120) = 7.69 M; (N / 0.1875) ** (1/3) = 344.9 -> 384.
    compute = 180 * 197e12 * 0.2
    assert math.sqrt(compute / 120) == pytest.approx(7.69e6, rel=1e-3)
    # Activations of 128 windows of 512 bytes, float32, 6 layers: 4 * (9 * 384 + 2 * 6 * 512) bytes a token
    # and layer = 15.1 GB in one microbatch, over half the 15.75 GiB; 7.5 GB in two is under.
    assert activation_bytes(128, d_model=384, n_layers=6, n_heads=6, seq_len=512) == 128 * 512 * 6 * 38_400
    assert sized is not None and sized.fields == {
        "d_model": 384, "n_layers": 6, "n_heads": 6, "d_ff": 1536, "seq_len": 512, "batch_size": 128,
        "microbatches": 2, "data": "@python",
    }  # fmt: skip
    assert "N = sqrt(C/120) = 7.7 M" in sized.reason and "--batch-size" in sized.reason
    config = RunConfig(**sized.fields).validate()  # a config the run accepts
    assert config.batch_size % config.microbatches == 0


def test_more_compute_a_wider_model_less_memory_more_microbatches():
    widths = [size_for_machine("tpu", "TPU v5 lite", V5E_MEMORY, t).fields["d_model"] for t in (60, 180, 3600, 86400)]
    assert widths == sorted(widths) and widths[0] >= 256 and widths[-1] <= 2048 and widths[-1] > widths[0]
    h100 = size_for_machine("gpu", "NVIDIA H100 80GB HBM3", None, 180.0).fields
    assert h100["d_model"] > 384  # 989 TFLOP/s: 5x the v5e's compute, a wider model
    tight = size_for_machine("tpu", "TPU v5 lite", 2 * 2**30, 180.0).fields
    assert tight["microbatches"] > 2 and tight["batch_size"] % tight["microbatches"] == 0
    unknown = size_for_machine("gpu", "Some GPU", 8 * 2**30, 180.0)
    assert unknown is not None and "no preset for 'Some GPU'" in unknown.reason
    assert size_for_machine("cpu", "cpu", None, 180.0) is None


@pytest.mark.parametrize("budget", [-5.0, 0, math.nan, math.inf, "180", True])
def test_a_budget_that_is_no_duration_is_one_line_naming_it(budget):
    message = rf"^budget_s \(--time-budget\) must be a finite number of seconds > 0, got {re.escape(repr(budget))}$"
    for platform, kind in (("tpu", "TPU v5 lite"), ("cpu", "cpu")):
        with pytest.raises(ValueError, match=message):
            size_for_machine(platform, kind, V5E_MEMORY, budget)


@pytest.mark.parametrize("memory", [-1, 0, 2.5])
def test_a_memory_that_is_no_byte_count_is_one_line_naming_it(memory):
    with pytest.raises(ValueError, match=r"^memory_bytes \(the device's bytes_limit\) must be None or an int > 0"):
        size_for_machine("tpu", "TPU v5 lite", memory, 180.0)


def _fake_tpu(monkeypatch):
    device = SimpleNamespace(
        platform="tpu", device_kind="TPU v5 lite", memory_stats=lambda: {"bytes_limit": V5E_MEMORY}
    )
    monkeypatch.setattr(jax, "devices", lambda *a: [device])


def test_the_cli_sizes_only_when_no_flag_does(monkeypatch):
    from leanstep.cli.main import build_parser
    from leanstep.cli.train import _config_from
    from leanstep.training.machine_size import choose_for_machine

    parser = build_parser()

    def config(*argv):
        return choose_for_machine(_config_from(parser.parse_args(["train", *argv]))).config

    assert config() == choose_for_machine(RunConfig()).config  # the CPU: today's defaults
    assert config().size == "mini" and config().d_model is None
    _fake_tpu(monkeypatch)
    sized = config("--lr", "1e-3")  # a flag the rule does not set
    assert (sized.d_model, sized.batch_size, sized.seq_len, sized.data, sized.lr) == (384, 128, 512, "@python", 1e-3)
    for flags in (["--batch-size", "64"], ["--size", "mini"], ["--data", "x"], ["--seq-len", "32"], ["--devices", "1"]):
        kept = config(*flags)
        assert kept.d_model is None and kept.data != "@python", flags
    assert config("--batch-size", "64").batch_size == 64  # given: kept
    assert config("--batch-size", "32").d_model is None  # given, even at its default: the flags size the run
    assert config("--model", "mlp").d_model is None  # the rule sizes the transformer only


def test_the_library_and_the_cli_train_the_same_run_on_an_accelerator(monkeypatch, tmp_path):
    """``train(RunConfig())`` and ``leanstep train`` with no sizing flag: one run (model, batch,
    data, precision), resolved by the library (``build_run``, which ``train`` calls first)."""
    from leanstep.cli.main import build_parser
    from leanstep.cli.train import _config_from
    from leanstep.training import build_run

    out = str(tmp_path / "run")
    cli = _config_from(build_parser().parse_args(["train", "--out", out]))
    _fake_tpu(monkeypatch)
    library, from_flags = build_run(RunConfig(out=out)), build_run(cli)
    assert library.config == from_flags.config and library.size_reason == from_flags.size_reason
    resolved = library.config
    assert (resolved.size, resolved.d_model, resolved.n_layers, resolved.batch_size, resolved.microbatches) == (
        "mini",
        384,
        6,
        128,
        2,
    )
    assert resolved.data == "@python" and "compute=bfloat16" in resolved.precision
    assert "sized for TPU v5 lite" in library.size_reason and library.model.config.d_model == 384
    assert build_run(resolved).config == resolved and build_run(resolved).size_reason is None  # resolved once


def test_size_auto_is_mini_where_the_machine_does_not_size(monkeypatch):
    from leanstep.training.machine_size import choose_for_machine

    assert RunConfig().size == "auto"
    choice = choose_for_machine(RunConfig())
    assert choice.config.size == "mini" and choice.size_reason is None  # a CPU
    _fake_tpu(monkeypatch)
    for config in (RunConfig(model="mlp"), RunConfig(devices=1), RunConfig(seq_len=64), RunConfig(size="tiny")):
        chosen = choose_for_machine(config)
        assert chosen.config.d_model is None and chosen.size_reason is None, config
    priced = choose_for_machine(RunConfig(), priced_accelerator=True)  # a cluster priced: never sized
    assert priced.config.d_model is None and "compute=bfloat16" in priced.config.precision


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)


def test_package_files_takes_py_sources_only(tmp_path):
    _tree(tmp_path, {
        "pkg/a.py": b"a = 1\n", "pkg/b.txt": b"not python", "pkg/__pycache__/c.py": b"x", "pkg/.hidden/d.py": b"x",
        "pkg/empty.py": b"", "pkg/bin.py": b"\0\1", "z.py": b"z = 2\n",
    })  # fmt: skip
    (tmp_path / "pkg" / "link.py").symlink_to(tmp_path / "z.py")
    found = installed_corpus.package_files(roots=[tmp_path])
    assert found == [("packages/pkg/a.py", b"a = 1\n"), ("packages/z.py", b"z = 2\n")]
    assert installed_corpus.package_files(max_bytes=7, roots=[tmp_path]) == found[:1]  # z.py would pass 7 bytes


def test_python_corpus_holds_out_the_stdlib_files_and_never_trains_on_them(tmp_path, monkeypatch):
    default = load_corpus(None)
    copied = default.heldout_files[0]  # a package that vendors a held-out file: left out of training
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    _tree(tmp_path, {"vendored/" + copied: (stdlib / copied).read_bytes(), "pkg/mod.py": b"def f():\n    return 1\n"})
    monkeypatch.setattr(installed_corpus, "package_roots", lambda: [tmp_path])
    monkeypatch.setattr(data_module, "package_roots", lambda: [tmp_path])
    corpus = load_corpus("@python", seq_len=32)
    assert corpus.heldout_files == default.heldout_files and bytes(corpus.heldout) == bytes(default.heldout)
    assert corpus.train_files == (*default.train_files, "packages/pkg/mod.py")
    assert bytes(corpus.train) == bytes(default.train) + b"def f():\n    return 1\n"
    described = json.loads(json.dumps(corpus.describe()))
    hashes = described["file_sha256"]
    assert hashes["train"]["packages/pkg/mod.py"] == hashlib.sha256(b"def f():\n    return 1\n").hexdigest()
    for name in default.heldout_files:  # every held-out file's hash is its bytes' on disk
        assert hashes["heldout"][name] == hashlib.sha256((stdlib / name).read_bytes()).hexdigest()
    assert set(hashes["train"]) == set(corpus.train_files) and "file_sha256" not in default.describe()
