"""What verify returns: one :class:`CheckResult` a check, gathered in a :class:`VerifyReport`.

The library reports values; ``leanstep verify`` renders them (a table, and the JSON of
:meth:`VerifyReport.to_json`).

Example:
  >>> ok = CheckResult("accumulation", "pass", "G(M=4) against sum_j w_j g_j", 3e-9, 1e-7, "gamma_6 sum |w_j g_j|")
  >>> bad = CheckResult("clip", "fail", "clipped gradient", 0.01, 1e-6, "norm bound", where="w[3]",
  ...                   diagnosis="norm summed in bfloat16 (maxtext#5143)")
  >>> report = VerifyReport("example", (ok, bad))
  >>> report.passed, [c.name for c in report.failures], report["clip"].where
  (False, ['clip'], 'w[3]')
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

__all__ = ["STATUSES", "CheckResult", "VerifyReport"]

#: A check passes, fails, or does not apply to the setup (``"n/a"``, with the reason in ``detail``).
STATUSES = ("pass", "fail", "n/a")


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One check's outcome.

    Attributes:
      name: the check (``"accumulation"``, ``"clip"``, ...).
      status: one of :data:`STATUSES`.
      compared: what was compared with what.
      largest: the largest difference found (the unit is the check's: see ``compared``).
      bound: the largest difference allowed (0: bit for bit).
      tolerance: how ``bound`` is derived.
      where: on a failure, where the difference first or most appears: the leaf (``"blocks/0/w[12]"``)
        and, where it applies, the microbatch.
      diagnosis: on a failure, the known bug the difference is the signature of, by name.
      detail: anything else worth a line (why a check does not apply, the measured weights).
      seconds: the time the check took, compiles included.
    """

    name: str
    status: str
    compared: str
    largest: float
    bound: float
    tolerance: str
    where: str | None = None
    diagnosis: str | None = None
    detail: str | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status: expected one of {STATUSES}, got {self.status!r}")

    @property
    def failed(self) -> bool:
        """The check ran and found a difference past its bound."""
        return self.status == "fail"

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (inf and NaN as strings)."""
        out = dataclasses.asdict(self)
        for key in ("largest", "bound"):
            value = out[key]
            out[key] = value if math.isfinite(value) else str(value)
        return out


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Every check's result for one setup.

    Attributes:
      setup: what was verified, in words.
      checks: the results, in the order they ran.
    """

    setup: str
    checks: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        """No check failed (``"n/a"`` checks do not count against it)."""
        return not self.failures

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        """The failed checks."""
        return tuple(c for c in self.checks if c.failed)

    @property
    def verdict(self) -> str:
        """The report in one phrase: the failures counted; nothing verified where every check is
        ``"n/a"``; and, where the ``reference`` check was asked for and is ``"n/a"``, that the one
        check independent of the step did not run, so a gradient wrong the same way in every
        microbatch (by a factor, say) passes every other check.
        """
        if self.failures:
            return f"{len(self.failures)} check(s) FAILED"
        if all(c.status == "n/a" for c in self.checks):
            return f"nothing verified: every check asked for ({len(self.checks)}) does not apply (n/a)"
        if any(c.name == "reference" and c.status == "n/a" for c in self.checks):
            return (
                "every check that applies passed, but the independent reference did not run (n/a): the step was "
                "compared with itself only, which a gradient wrong in every microbatch alike passes"
            )
        return "every check passed"

    def __getitem__(self, name: str) -> CheckResult:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"no check named {name!r}; the report has {[c.name for c in self.checks]}")

    def to_json(self) -> str:
        """The report as JSON: ``{"setup", "passed", "verdict", "checks": [CheckResult.to_dict(), ...]}``."""
        body = {
            "setup": self.setup,
            "passed": self.passed,
            "verdict": self.verdict,
            "checks": [c.to_dict() for c in self.checks],
        }
        return json.dumps(body, indent=2)

    def __str__(self) -> str:
        lines = [f"verify {self.setup}: {self.verdict}"]
        for c in self.checks:
            lines.append(f"  {c.status:4} {c.name:16} largest {c.largest:.3g} (bound {c.bound:.3g}): {c.compared}")
            for label, value in (("where", c.where), ("diagnosis", c.diagnosis), ("detail", c.detail)):
                if value:
                    lines.append(f"       {label}: {value}")
        return "\n".join(lines)
