"""No false alarms: 20 random valid configurations of the built-in models pass every check of leanstep verify.

Precision (float32, bfloat16, bfloat16 strict, float16), microbatches, remat policy, loss scale,
FP8 recipe and a mesh layout are drawn from a seeded generator; each configuration runs every
check, the mesh layout among them, in one subprocess with 4 simulated devices. Slow (about five
minutes on 2 cores): ``pytest -m slow tests/test_verification_configs.py``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from workers import run_worker

COUNT = 20


def configurations(count: int = COUNT, seed: int = 0) -> list[dict]:
    """``count`` valid RunConfig fields and a mesh layout each, drawn from ``seed``."""
    rng = random.Random(seed)
    precisions = [
        "float32",
        "params=float32,compute=bfloat16,output=float32",
        "params=float32,compute=bfloat16,output=float32,strict",
        "params=float32,compute=float16,output=float32",
    ]
    out = []
    for _ in range(count):
        model = rng.choice(["transformer", "mlp"])
        precision = rng.choice(precisions)
        fields = dict(
            model=model,
            size="tiny",
            batch_size=16,
            seq_len=16,
            precision=precision,
            microbatches=rng.choice([2, 4]),
            remat=rng.choice(["none", "dots", "full", "dots_no_batch"]),
            loss_scale="dynamic" if "float16" in precision else rng.choice(["none", "dynamic"]),
            max_grad_norm=rng.choice([None, 1.0]),
            fp8=rng.choice(["none", "delayed", "current"]) if model == "transformer" else "none",
        )
        layout = rng.choice(
            ["data=2", "fsdp=2", "data=2,fsdp=2", "data=2,tensor=2" if model == "transformer" else "data=4"]
        )
        out.append({"fields": fields, "layout": layout})
    return out


def worker(out: Path) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    import leanstep
    from leanstep.training import RunConfig
    from leanstep.training.verify_run import checked_config, verify_setup

    results = []
    for case in configurations():
        config = checked_config(RunConfig(**case["fields"]))
        report = leanstep.verification.verify_step(
            verify_setup(config), num_microbatches=config.microbatches, meshes=(case["layout"],), name=str(case)
        )
        results.append({"case": case, "passed": report.passed, "report": str(report)})
        (out / "configs.json").write_text(json.dumps(results))  # after each: a slow run shows its progress


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_twenty_random_configurations_pass_every_check(tmp_path):
    results = run_worker(__file__, tmp_path, "configs.json", timeout=1800)
    assert len(results) == COUNT
    failed = [r["report"] for r in results if not r["passed"]]
    assert not failed, "\n\n".join(failed)


def test_the_configurations_are_valid_and_varied():
    from leanstep.training import RunConfig

    cases = configurations()
    for case in cases:
        RunConfig(**case["fields"]).validate()
    for field in ("precision", "microbatches", "remat", "loss_scale", "fp8"):
        assert len({str(c["fields"][field]) for c in cases}) > 1, field
    assert len({c["layout"] for c in cases}) > 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    worker(Path(sys.argv[2]))
