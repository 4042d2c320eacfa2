"""The checksum manifest of a checkpoint step: what it vouches for, how it is written and checked.

A finished step directory holds ``leanstep_manifest.json`` (:data:`MANIFEST_NAME`)::

    {"format": "leanstep-checkpoint-manifest/1", "step": <step>,
     "leaves": [[keypath, shape, dtype], ...],          the state pytree's leaves, in order
     "files":  {relative path: [size, sha256], ...},    every other file of the step
     "digest": sha256(json of everything above, keys sorted)}

:func:`write_manifest` hashes the files and writes the manifest atomically (temporary file,
``fsync``, ``os.replace``, ``fsync`` of the directory). :func:`verify_manifest` raises
:class:`RejectedStep`, saying why, unless the manifest is there, intact, for that step, the
files match it byte for byte, and its leaves are the template's.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST_FORMAT", "MANIFEST_NAME", "RejectedStep", "verify_manifest", "write_manifest"]

MANIFEST_NAME = "leanstep_manifest.json"
MANIFEST_FORMAT = "leanstep-checkpoint-manifest/1"
_CHUNK = 1 << 20


class RejectedStep(Exception):
    """One step failed verification or restore; the message says why."""


def hash_files(step_dir: Path) -> dict[str, list[Any]]:
    """``{relative path: [size, sha256 hex]}`` of every file under ``step_dir`` but the manifest."""
    files = {}
    for root, dirs, names in os.walk(step_dir):
        dirs.sort()
        for name in sorted(names):
            path = Path(root, name)
            rel = path.relative_to(step_dir).as_posix()
            if rel.startswith(MANIFEST_NAME):
                continue
            digest, size = hashlib.sha256(), 0
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
            files[rel] = [size, digest.hexdigest()]
    return files


def manifest_digest(body: Mapping[str, Any]) -> str:
    """sha256 of the manifest body as JSON with sorted keys.

    Example:
      >>> manifest_digest({"step": 1})[:12]
      '66acd07fcea2'
    """
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_json_atomically(path: Path, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path`` so that a crash leaves the old file or the new one, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(step_dir: Path, step: int, leaves: list[list[Any]]) -> None:
    """Hashes the files of ``step_dir`` and writes its manifest atomically.

    Raises:
      OSError: reading a file or writing the manifest failed.
    """
    body = {"format": MANIFEST_FORMAT, "step": step, "leaves": leaves}
    body["files"] = hash_files(step_dir)
    write_json_atomically(step_dir / MANIFEST_NAME, {**body, "digest": manifest_digest(body)})


def first_three(problems: list[str]) -> str:
    """The first three problems, and how many more there are.

    Example:
      >>> first_three(["a", "b", "c", "d", "e"])
      'a; b; c (and 2 more)'
    """
    return "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")


#: Where a :class:`leanstep.TrainState`'s optimizer state lies in its leaves' key paths.
_OPT_STATE = ".opt_state"


def moments_format(leaves: list[list[Any]]) -> str | None:
    """The format of a train state's optimizer moments, from its leaves (``[keypath, shape,
    dtype]``): ``"int8"`` (8-bit codes, :func:`leanstep.blocks.compress_moments`), ``"bfloat16"``
    or ``"float32"``; None for a tree without a ``.opt_state`` holding floating leaves.

    Example:
      >>> moments_format([[".opt_state[0].mu['w']", [3], "bfloat16"], [".opt_state[0].count", [], "int32"]])
      'bfloat16'
    """
    dtypes = {dtype for path, _, dtype in leaves if path.startswith(_OPT_STATE)}
    for dtype, form in (("uint8", "int8"), ("bfloat16", "bfloat16"), ("float32", "float32")):
        if dtype in dtypes:
            return form
    return None


def describe_mismatch(saved: list[list[Any]], wanted: list[list[Any]]) -> str:
    """Why the leaves on disk (``[keypath, shape, dtype]``) are not the template's: first, a train
    state's moments saved in another format than the template's (:func:`moments_format`), with
    the argument that chooses it; else the first leaves that differ.

    Example:
      >>> describe_mismatch([["['w']", [3], "float32"]], [["['w']", [3], "bfloat16"]])
      "state does not match the template: ['w'] is float32[3] in the checkpoint, bfloat16[3] in the template"
      >>> describe_mismatch([[".opt_state[0].mu", [3], "float32"]], [[".opt_state[0].mu[0]", [3], "uint8"]]).split("; ")[0][35:]
      "the checkpoint's optimizer moments are float32, the template's int8"
    """
    formats = moments_format(saved), moments_format(wanted)
    if None not in formats and formats[0] != formats[1]:
        return (
            f"state does not match the template: the checkpoint's optimizer moments are {formats[0]}, the template's "
            f"{formats[1]}; restore it into a state built with moments={formats[0]!r} (TrainState.create(..., "
            f"moments=...) or StepSpec.moments; --moments in leanstep train), the format it was saved in"
        )
    on_disk = {path: f"{dtype}{shape}" for path, shape, dtype in saved}
    template = {path: f"{dtype}{shape}" for path, shape, dtype in wanted}
    problems = [f"{p} missing from the checkpoint" for p in template if p not in on_disk]
    problems += [f"{p} in the checkpoint but not in the template" for p in on_disk if p not in template]
    problems += [
        f"{p} is {on_disk[p]} in the checkpoint, {t} in the template"
        for p, t in template.items()
        if p in on_disk and on_disk[p] != t
    ]
    return "state does not match the template: " + first_three(problems or ["leaves in another order"])


def verify_manifest(step_dir: Path, step: int, leaves: list[list[Any]]) -> None:
    """Checks ``step_dir`` against its manifest and the template's ``leaves``.

    Raises:
      RejectedStep: no manifest, an unreadable, foreign or corrupted one, files that do not
        match it, or leaves that are not the template's; the message says which.
    """
    try:
        with open(step_dir / MANIFEST_NAME) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise RejectedStep("no manifest (the save was interrupted before it was verified)") from None
    except (OSError, ValueError) as e:
        raise RejectedStep(f"manifest unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise RejectedStep(f"manifest is not a {MANIFEST_FORMAT} manifest")
    digest = manifest.pop("digest", None)
    if digest != manifest_digest(manifest) or manifest.get("step") != step:
        raise RejectedStep("manifest is corrupted (its digest or step does not match)")
    expected, found = manifest["files"], hash_files(step_dir)
    problems = [f"{f} missing" for f in sorted(expected.keys() - found.keys())]
    problems += [f"{f} unexpected" for f in sorted(found.keys() - expected.keys())]
    for name in sorted(expected.keys() & found.keys()):
        (size, sha), (found_size, found_sha) = expected[name], found[name]
        if found_size != size:
            problems.append(f"{name} has {found_size} bytes, expected {size}")
        elif found_sha != sha:
            problems.append(f"{name} has the wrong sha256")
    if problems:
        raise RejectedStep("files do not match the manifest: " + first_three(problems))
    if manifest["leaves"] != leaves:
        raise RejectedStep(describe_mismatch(manifest["leaves"], leaves))
