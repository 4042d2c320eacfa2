"""leanstep bench --speedrun: compressor references, the PyTorch peer's numbers and sizing, the CLI's flags.

leanstep's own run is not trained here (compiling it takes minutes on a loaded 2-core machine);
its part of :func:`run_speedrun` is checked with a stand-in for ``train`` that writes what the
trainer writes.
"""

from __future__ import annotations

import gzip
import json
import lzma
import math
import shutil
import statistics
import subprocess
import sysconfig
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

import leanstep.training
from leanstep.bench import speedrun, speedrun_torch
from leanstep.bench.speedrun import compression_references, run_speedrun
from leanstep.bench.speedrun_torch import choose_torch_precision
from leanstep.cli.main import main
from leanstep.training import RunConfig
from leanstep.training.auto_precision import FLOAT32
from leanstep.training.budget import plan_steps
from leanstep.training.data import BatchSampler, heldout_batches, load_corpus

STDLIB_FILES = ("textwrap.py", "shlex.py", "json/decoder.py", "json/encoder.py")
TINY = {"size": "tiny", "batch_size": 4, "seq_len": 16, "microbatches": 2, "eval_batches": 3, "precision": FLOAT32}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Four stdlib modules (about 60 KB): three to train on, one held out."""
    folder = tmp_path_factory.mktemp("data")
    root = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_FILES:
        shutil.copy(root / name, folder / name.replace("/", "_"))
    return folder


@pytest.fixture
def one_thread():
    """One torch thread: on a loaded 2-core machine two threads spin against each other, making
    a tiny model's step 100x slower and the sizing tests slow (the peer itself keeps the default)."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- compressor references


def test_compression_references_match_zlib_and_the_command_line_tools(data):
    heldout = load_corpus(data).heldout
    refs = compression_references(heldout)
    raw = heldout.tobytes()
    deflater = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate; gzip adds a 10-byte header, 8-byte trailer
    assert refs["gzip"]["compressed_bytes"] == len(deflater.compress(raw) + deflater.flush()) + 18
    assert refs["bytes"] == len(raw)
    for key in ("gzip", "xz"):
        assert refs[key]["bits_per_byte"] == 8 * refs[key]["compressed_bytes"] / len(raw)
    assert lzma.decompress(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)) == raw
    assert gzip.decompress(gzip.compress(raw, 9, mtime=0)) == raw
    # GNU gzip has its own deflate and xz may split blocks: equal within a fraction of a percent.
    for key, tool in (("gzip", ["gzip", "-9", "-c"]), ("xz", ["xz", "-9e", "-c"])):
        if shutil.which(tool[0]) is None:
            continue
        size = len(subprocess.run(tool, input=raw, capture_output=True, check=True).stdout)
        assert abs(refs[key]["compressed_bytes"] - size) <= max(64, 0.005 * size), (key, size)
    assert refs["xz"]["bits_per_byte"] < refs["gzip"]["bits_per_byte"] < 8


@pytest.mark.parametrize(
    "heldout, error",
    [
        (b"", ValueError),
        (np.zeros(3, np.int32), ValueError),
        (np.zeros((2, 2), np.uint8), ValueError),
        ("text", TypeError),
    ],
)
def test_compression_references_refuse_what_is_not_bytes(heldout, error):
    with pytest.raises(error, match="heldout"):
        compression_references(heldout)


# ---------------------------------------------------------------- precision


@pytest.mark.parametrize("spec, device, expected", [
    ("auto", {"platform": "cpu", "flags": frozenset({"avx2", "fma"})}, False),
    ("auto", {"platform": "cpu", "flags": frozenset({"avx512f", "amx_bf16"})}, False),  # as leanstep: XLA:CPU
    ("auto", {"platform": "cuda", "compute_capability": "8.0"}, True),
    ("auto", {"platform": "cuda", "compute_capability": "7.0"}, False),
    ("params=float32,compute=bfloat16,output=float32", {"platform": "cpu", "flags": frozenset({"avx2"})}, False),
    ("params=float32,compute=bfloat16,output=float32", {"platform": "cpu", "flags": frozenset({"avx512_bf16"})}, True),
    (FLOAT32, {"platform": "cpu", "flags": frozenset({"amx_bf16"})}, False),
])  # fmt: skip
def test_torch_precision_is_bfloat16_only_on_native_bfloat16_hardware(spec, device, expected):
    bfloat16, reason = choose_torch_precision(spec, **device)
    assert bfloat16 is expected
    assert reason.startswith(f"--precision {spec}")


# ---------------------------------------------------------------- the PyTorch peer


def _layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * scale + bias


def numpy_loss(weights: dict[str, np.ndarray], tokens: np.ndarray, n_heads: int, n_layers: int) -> float:
    """Mean next-byte cross-entropy (nats) of leanstep's transformer, written out in float64 NumPy."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    batch, time = inputs.shape
    x = weights["embed.weight"][inputs] + weights["pos"][:time]
    d = x.shape[-1]
    causal = np.tril(np.ones((time, time), bool))
    for i in range(n_layers):
        w = {name[len(f"blocks.{i}.") :]: v for name, v in weights.items() if name.startswith(f"blocks.{i}.")}
        qkv = _layer_norm(x, w["ln1.weight"], w["ln1.bias"]) @ w["qkv.weight"].T + w["qkv.bias"]
        q, k, v = np.moveaxis(qkv.reshape(batch, time, n_heads, 3, d // n_heads), 3, 0)  # head-major, as leanstep
        scores = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // n_heads)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("bhts,bshd->bthd", probs, v).reshape(batch, time, d) @ w["proj.weight"].T + w["proj.bias"]
        hidden = _layer_norm(x, w["ln2.weight"], w["ln2.bias"]) @ w["fc.weight"].T + w["fc.bias"]
        gelu = 0.5 * hidden * (1 + np.tanh(math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden**3)))
        x = x + gelu @ w["out.weight"].T + w["out.bias"]
    logits = _layer_norm(x, weights["ln_f.weight"], weights["ln_f.bias"]) @ weights["embed.weight"].T
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return float(-np.take_along_axis(log_probs, targets[..., None], -1).mean())


def _float64(model) -> dict[str, np.ndarray]:
    return {name: value.detach().double().numpy() for name, value in model.state_dict().items()}


def test_peer_trains_on_leanstep_batches_under_its_recipe_and_reports_float64_bits(data, one_thread):
    torch = pytest.importorskip("torch")
    from leanstep.bench.speedrun_torch import train_torch_peer
    from leanstep.bench.torch_step import build_torch_model
    from leanstep.models import build_model

    # Three steps of warmup-cosine with one warmup step: learning rates 0, lr, 0.55 lr (the cosine's midpoint).
    config = RunConfig(
        **TINY,
        optimizer="adamw",
        steps=3,
        time_budget=None,
        warmup_steps=1,
        lr=1e-2,
        weight_decay=0.1,
        schedule="warmup-cosine",
        max_grad_norm=0.5,
        seed=3,
        data=str(data),
    )
    peer = train_torch_peer(config, torch_compile=False)

    # The reference: full-batch gradients of the same initial model on BatchSampler's batches, then
    # global-norm clipping and AdamW in float64 NumPy.
    model_config = build_model("transformer", "tiny", seq_len=16).config
    reference = build_torch_model(model_config, remat=False, seed=3)
    corpus = load_corpus(data, seq_len=16)
    sampler = BatchSampler(corpus.train, 4, 16, 3)
    params = dict(reference.named_parameters())
    weights = {name: p.detach().double().numpy() for name, p in params.items()}
    mu = {name: np.zeros_like(w) for name, w in weights.items()}
    nu = {name: np.zeros_like(w) for name, w in weights.items()}
    for step, lr in enumerate((0.0, 1e-2, 0.55e-2)):
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(torch.from_numpy(weights[name]).float())
        reference.zero_grad()
        reference(torch.from_numpy(sampler.batch_at(step)["tokens"]).long()).backward()
        grads = {name: p.grad.double().numpy() for name, p in params.items()}
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        scale = min(1.0, 0.5 / (norm + 1e-6))
        for name, g in grads.items():
            g = g * scale
            mu[name] = 0.9 * mu[name] + 0.1 * g
            nu[name] = 0.95 * nu[name] + 0.05 * g * g
            update = (mu[name] / (1 - 0.9 ** (step + 1))) / (np.sqrt(nu[name] / (1 - 0.95 ** (step + 1))) + 1e-8)
            weights[name] = weights[name] - lr * (update + 0.1 * weights[name])
    trained = _float64(peer.model)
    for name, w in weights.items():
        np.testing.assert_allclose(trained[name], w, rtol=1e-4, atol=2e-5, err_msg=name)

    batches = heldout_batches(corpus.heldout, 4, 16, 3)
    expected = np.mean(
        [numpy_loss(trained, b["tokens"], model_config.n_heads, model_config.n_layers) for b in batches]
    ) / math.log(2)
    result = peer.result
    assert result["heldout_bits_per_byte"] == pytest.approx(expected, rel=1e-5)
    assert result["heldout_curve"][-1] == [3, result["heldout_bits_per_byte"]]
    assert (result["steps"], result["planned_steps"], result["tokens"]) == (3, 3, 3 * 4 * 16)
    assert result["precision"] == "float32" and result["torch_compile"] is False and result["budget_s"] is None


def test_peers_muon_takes_leansteps_muon_steps(data, one_thread):
    pytest.importorskip("torch")
    import optax

    from leanstep.bench.speedrun_torch import train_torch_peer
    from leanstep.bench.torch_step import build_torch_model, load_jax_params
    from leanstep.training.build import build_optimizer, build_run

    config = RunConfig(
        **TINY, optimizer="muon", steps=3, time_budget=None, warmup_steps=1, lr=1e-2, weight_decay=0.1,
        schedule="warmup-cosine", max_grad_norm=0.5, seed=3, data=str(data),
    )  # fmt: skip
    run = build_run(config)
    params = initial = jax.device_get(run.init_state().params)
    peer = train_torch_peer(config, torch_compile=False, initial_params=params)
    # The reference: leanstep's optax optimizer (Muon for the stacked matrices, AdamW for the rest) on
    # full-batch JAX gradients, clipped by hand as torch's clip_grad_norm_ clips.
    optimizer, _ = build_optimizer(config)
    state = optimizer.init(params)
    sampler = BatchSampler(load_corpus(data, seq_len=16).train, 4, 16, 3)
    for step in range(3):
        grads = jax.grad(run.model.loss)(params, sampler.batch_at(step))
        norm = math.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(grads)))
        scale = min(1.0, 0.5 / (norm + 1e-6))
        grads = jax.tree.map(lambda g, scale=scale: g * scale, grads)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    expected = build_torch_model(run.model.config, remat=False)
    load_jax_params(expected, params)
    trained, reference = _float64(peer.model), _float64(expected)
    assert peer.result["adamw"].endswith("Muon for the blocks' matrices")
    for name, w in reference.items():
        np.testing.assert_allclose(trained[name], w, rtol=1e-4, atol=2e-5, err_msg=name)
    start = build_torch_model(run.model.config, remat=False)
    load_jax_params(start, initial)  # Muon moved the matrices: the comparison is not of two no-ops
    assert not np.allclose(trained["blocks.0.fc.weight"], _float64(start)["blocks.0.fc.weight"], atol=1e-3)


def test_peer_started_from_leanstep_initial_params_has_leanstep_first_loss(data, one_thread):
    pytest.importorskip("torch")
    from leanstep.bench.speedrun_torch import train_torch_peer
    from leanstep.training.build import build_run

    config = RunConfig(**TINY, steps=1, time_budget=None, seed=5, data=str(data))
    run = build_run(config)
    params = jax.device_get(run.init_state().params)
    batch = BatchSampler(load_corpus(data, seq_len=16).train, 4, 16, 5).batch_at(0)
    expected = float(run.model.loss(params, batch))  # leanstep's loss of its first step, before any update
    peer = train_torch_peer(config, torch_compile=False, initial_params=params).result
    assert peer["init"] == "leanstep's initial parameters"
    assert peer["final_train_loss"] == pytest.approx(expected, rel=1e-5)
    own = train_torch_peer(config, torch_compile=False).result  # its own GPT-2 draws: another first loss
    assert own["init"] == "GPT-2 (seed 5)" and own["final_train_loss"] != pytest.approx(expected, rel=1e-3)


def test_peer_sizes_its_run_from_the_measured_step_and_stops_within_the_budget(data, one_thread):
    pytest.importorskip("torch")
    from leanstep.bench.speedrun_torch import train_torch_peer

    budget = 3.5
    config = RunConfig(**TINY, time_budget=budget, eval_every=25, data=str(data))
    result = train_torch_peer(config, torch_compile=False).result
    assert result["step_s"] == statistics.median(result["step_times_s"]) and len(result["step_times_s"]) == 4
    assert (
        result["calibrated_steps"]
        == plan_steps(
            budget, result["planned_at_s"], result["step_s"], result["eval_s"], 25, 0.0, config.checkpoint_every, 0.0
        )
        >= 1
    )
    if result["replan_at"] is not None and result["steps"] >= result["replan_at"]:
        # Planned again as leanstep's loop plans: the time left at the loop's own pace.
        at = result["replan_at"]
        expected = at + max(
            1,
            plan_steps(
                budget,
                result["replanned_at_s"],
                result["loop_step_s"],
                result["eval_s"],
                25,
                0.0,
                config.checkpoint_every,
                0.0,
            ),
        )
        while expected - expected // 5 <= at:  # warmup-stable-decay: the decay never starts before the replan
            expected += 1
        assert result["planned_steps"] == expected
    else:
        assert result["planned_steps"] == result["calibrated_steps"]
    assert 1 <= result["steps"] <= result["planned_steps"]
    assert result["stopped_at_budget"] == (result["steps"] < result["planned_steps"])
    assert result["elapsed_s"] <= budget + result["slowest_step_s"] + result["final_eval_s"]
    assert result["tokens"] == result["steps"] * 4 * 16
    assert [step for step, _ in result["heldout_curve"]] == [*range(25, result["steps"], 25), result["steps"]]
    assert math.isfinite(result["heldout_bits_per_byte"])


def test_a_peer_stopped_right_after_a_periodic_evaluation_has_one_point_at_its_last_step():
    # The budget stopped the loop at step 50, just after its evaluation there: the final
    # evaluation (the same parameters) is the step's one point, as leanstep's loop records it.
    from types import SimpleNamespace

    from leanstep.bench.torch_peer import PeerLoop

    fake_torch = SimpleNamespace(__version__="0", get_num_threads=lambda: 1)
    peer = SimpleNamespace(
        config=RunConfig(**TINY), torch=fake_torch, evaluate=lambda: 2.5, bfloat16=False, forward=None, model=None
    )
    peer.compile_reason, peer.adamw, peer.device = "", "", "cpu"
    loop = PeerLoop([1.0] * 50, [[25, 3.0], [50, 2.6]], 50, 80, True, [0.1] * 50, None, None)
    result = speedrun_torch._peer_result(
        peer, loop, start=0.0, budget_s=None, precision_reason="", remat=False, init=""
    )
    assert result["heldout_curve"] == [[25, 3.0], [50, 2.5]] and result["heldout_bits_per_byte"] == 2.5
    loop = PeerLoop([1.0] * 49, [[25, 3.0]], 49, 80, True, [0.1] * 49, None, None)
    result = speedrun_torch._peer_result(
        peer, loop, start=0.0, budget_s=None, precision_reason="", remat=False, init=""
    )
    assert result["heldout_curve"] == [[25, 3.0], [49, 2.5]]


def test_peer_refuses_a_budget_without_time_for_a_step(data, one_thread):
    pytest.importorskip("torch")
    from leanstep.bench.speedrun_torch import train_torch_peer

    with pytest.raises(ValueError, match="--time-budget 0.001s leaves the PyTorch peer no time"):
        train_torch_peer(RunConfig(**TINY, time_budget=0.001, data=str(data)), torch_compile=False)


# ---------------------------------------------------------------- run_speedrun


def _stand_in_train(calls: list):
    """A ``train`` that records its config and writes what the trainer writes (no training)."""

    def train(config, *, resume=False, on_record=None):
        calls.append(config)
        out = Path(config.out)
        out.mkdir(parents=True)
        run = {**config.to_json(), "steps": 7, "precision": FLOAT32}
        plan = {"planned_at_s": 1.0, "compile_s": 0.5, "step_s": 0.1, "step_times_s": [0.1] * 4, "eval_s": 0.2}
        (out / "config.json").write_text(
            json.dumps({"run": run, "precision_reason": "a stand-in", "time_budget_plan": plan})
        )
        on_record(leanstep.training.Note("7 steps planned"))
        return {
            "steps": 7,
            "final_heldout_bits_per_byte": 5.0,
            "final_heldout_loss": 5.0 * math.log(2),
            "final_train_loss": 3.0,
            "total_time_s": 2.5,
            "skipped_steps": 0,
        }

    return train


def test_run_speedrun_gives_both_contenders_one_config_and_budget(data, tmp_path, monkeypatch, one_thread):
    calls: list = []
    monkeypatch.setattr(leanstep.training, "train", _stand_in_train(calls))
    scored = []  # the stand-in writes no checkpoint: leanstep's every-window score is stood in for too
    monkeypatch.setattr(speedrun, "_leanstep_every_window", lambda config, windows: scored.append(windows) or 4.5)
    # Asked for bfloat16 on a CPU with bfloat16 units the peer would autocast; it computes in what
    # leanstep's run recorded (the stand-in's float32) instead.
    monkeypatch.setattr(speedrun_torch, "_device", lambda torch: ("cpu", None, frozenset({"amx_bf16"})))
    bf16 = {**TINY, "precision": "params=float32,compute=bfloat16,output=float32"}
    result = run_speedrun(3.0, config=RunConfig(**bf16), out=tmp_path / "sr", data=data, torch_compile=False)
    (config,) = calls
    assert (config.time_budget, config.steps, config.out, config.progress, config.data) == (
        3.0,
        None,
        str(tmp_path / "sr" / "leanstep"),
        False,
        str(data),
    )
    assert result["config"] == config.to_json() and result["budget_s"] == 3.0
    lean, peer = result["contenders"]["leanstep"], result["contenders"]["pytorch"]
    assert (lean["steps"], lean["tokens"], lean["heldout_bits_per_byte"], lean["compile_s"]) == (7, 7 * 64, 5.0, 0.5)
    assert lean["precision"] == "float32" and lean["notes"] == ["7 steps planned"]
    assert peer["budget_s"] == 3.0 and peer["steps"] >= 1 and peer["wall_s"] >= peer["elapsed_s"]
    assert peer["init"] == "leanstep's initial parameters"  # the same weights: the runs differ in speed only
    assert peer["precision"] == "float32" and peer["precision_reason"] == f"--precision {FLOAT32} computes in float32"
    corpus = load_corpus(data, seq_len=16)
    assert result["references"]["bytes"] == compression_references(corpus.heldout)["bytes"]
    assert result["references"]["gzip"] == compression_references(corpus.heldout)["gzip"]
    every_window = heldout_batches(corpus.heldout, 4, 16)
    assert [len(w) for w in scored] == [len(every_window)] and lean["heldout_bits_per_byte_all"] == 4.5
    assert result["references"]["windows_bytes"] == 1 + 16 * 4 * len(every_window)  # windows share an edge
    assert math.isfinite(peer["heldout_bits_per_byte_all"]) and peer["heldout_bits_per_byte_all"] > 0
    json.dumps(result, allow_nan=False)

    with pytest.raises(ValueError, match="--out .* holds a speedrun already"):
        run_speedrun(3.0, config=RunConfig(**TINY), out=tmp_path / "sr", data=data)
    assert len(calls) == 1


def test_run_speedrun_checks_before_it_runs(data, tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(leanstep.training, "train", _stand_in_train(calls))
    with pytest.raises(ValueError, match="--time-budget"):
        run_speedrun(-1.0, config=RunConfig(**TINY), out=tmp_path / "a", data=data)
    with pytest.raises(ValueError, match="--model mlp: the PyTorch peer"):
        run_speedrun(3.0, config=RunConfig(**{**TINY, "model": "mlp"}), out=tmp_path / "b", data=data)
    monkeypatch.setattr(speedrun, "_leanstep_every_window", lambda config, windows: 4.5)
    result = run_speedrun(3.0, config=RunConfig(**TINY), out=tmp_path / "c", data=data, torch_peer=False)
    assert "skipped" in result["contenders"]["pytorch"] and len(calls) == 1


# ---------------------------------------------------------------- the CLI


CANNED = {
    "budget_s": 90.0,
    "contenders": {
        "leanstep": {"heldout_bits_per_byte": 3.5, "heldout_bits_per_byte_all": 3.4, "steps": 183, "tokens": 374784, "wall_s": 140.9, "compile_s": 27.9,
                     "precision": "float32", "precision_reason": "a CPU without AMX"},
        "pytorch": {"skipped": "torch is not installed"},
    },
    "references": {"bytes": 1000, "gzip": {"command": "gzip -9", "bits_per_byte": 1.84},
                   "xz": {"command": "xz -9e", "bits_per_byte": 1.55},
                   "windows_bytes": 999},
    "machine": {"cpu_model": "a CPU", "cores_available": 2, "jax": "0"},
}  # fmt: skip


@pytest.fixture
def recorded(monkeypatch):
    """Replaces run_speedrun with a recorder of its arguments returning CANNED: no CLI test trains."""
    calls = []

    def fake(budget_s, **kwargs):
        calls.append((budget_s, kwargs))
        return json.loads(json.dumps(CANNED))

    monkeypatch.setattr(speedrun, "run_speedrun", fake)
    return calls


@pytest.mark.parametrize(
    "text, seconds", [("3m", 180.0), ("180s", 180.0), ("180", 180.0), ("1.5m", 90.0), ("1h", 3600.0)]
)
def test_cli_reads_the_budget_and_writes_table_and_json(text, seconds, recorded, tmp_path, capsys):
    argv = [
        "bench",
        "--speedrun",
        "--time-budget",
        text,
        "--out",
        str(tmp_path / "runs"),
        "--json",
        str(tmp_path / "r.json"),
        "--quiet",
        "--size",
        "tiny",
        "--batch-size",
        "4",
        "--seed",
        "3",
        "--data",
        str(tmp_path),
        "--no-torch-compile",
    ]
    assert main(argv) == 0
    ((budget, kwargs),) = recorded
    assert budget == seconds and kwargs["out"] == str(tmp_path / "runs") and kwargs["torch_compile"] is False
    config = kwargs["config"]
    assert (config.size, config.batch_size, config.seed, config.data, config.time_budget) == (
        "tiny",
        4,
        3,
        str(tmp_path),
        seconds,
    )
    assert json.loads((tmp_path / "r.json").read_text())["contenders"] == CANNED["contenders"]
    out = capsys.readouterr().out
    for cell in ("leanstep", "3.4000", "3.5000", "183", "374,784", "gzip -9", "1.8400", "xz -9e", "1.5500", "skipped"):
        assert cell in out


@pytest.mark.parametrize("argv, message", [
    (["--speedrun", "--time-budget", "soon"], "--time-budget must be a duration like"),
    (["--speedrun", "--time-budget", "3x"], "--time-budget must be a duration like"),
    (["--speedrun", "--time-budget=-3m"], "--time-budget must be a duration like"),
    (["--speedrun", "--time-budget", "0"], "--time-budget must be a duration above zero"),
    (["--time-budget", "3m"], "--time-budget is a flag of --speedrun"),
    (["--out", "somewhere"], "--out is a flag of --speedrun"),
    (["--speedrun", "--repeats", "3"], "--repeats is a flag of the step benchmark"),
    (["--speedrun", "--quick"], "--quick is a flag of the step benchmark"),
    (["--speedrun", "--chart", "x.png"], "--chart: --speedrun draws no chart"),
    (["--speedrun", "--batch-size", "6", "--microbatches", "4"], "--batch-size 6 is not divisible by --microbatches 4"),
    (["--speedrun", "--remat", "sometimes"], "--remat"),
])  # fmt: skip
def test_cli_flag_errors_exit_2_naming_the_flag_before_running(argv, message, recorded, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
    assert recorded == []


def test_cli_json_path_is_checked_first_and_run_errors_exit_2(recorded, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    assert main(["bench", "--speedrun", "--json", str(tmp_path / "file" / "r.json")]) == 2
    assert "--json" in capsys.readouterr().err and recorded == []

    def refuses(budget_s, **kwargs):
        raise ValueError("--out 'x' holds a speedrun already")

    monkeypatch.setattr(speedrun, "run_speedrun", refuses)
    assert main(["bench", "--speedrun", "--quiet"]) == 2
    assert "holds a speedrun already" in capsys.readouterr().err


def test_step_pace_times_both_steps_in_turn(data, one_thread):
    from benchmarks.step_pace import step_pace

    with pytest.raises(ValueError, match="rounds=0"):
        step_pace(RunConfig(**TINY, data=str(data)), rounds=0)
    pytest.importorskip("torch")
    result = step_pace(RunConfig(**TINY, data=str(data)), rounds=2, steps=1)
    assert (result["rounds"], result["steps"]) == (2, 1)
    for name in ("leanstep", "pytorch"):
        assert 0 < result[name]["p25_ms"] <= result[name]["median_ms"] and result[name]["mean_ms"] > 0
    # The two steps time the same computation: from the same weights, the same first loss.
    assert result["pytorch"]["first_loss"] == pytest.approx(result["leanstep"]["first_loss"], rel=1e-5)
