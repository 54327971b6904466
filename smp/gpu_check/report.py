"""The gpu_check report: figures with their goals and verdicts, written as JSON and markdown."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, SKIPPED, INFO = "pass", "fail", "skipped", "info"  # INFO: a figure with no goal


@dataclass
class Figure:
    name: str
    value: Any
    unit: str = ""
    goal: str = ""
    status: str = INFO
    reason: str = ""


def check(name: str, value: Any, ok: bool, goal: str, unit: str = "", reason: str = "") -> Figure:
    """A figure judged against its goal (`ok`: whether the value meets it)."""
    return Figure(name, value, unit, goal, PASS if ok else FAIL, reason)


@dataclass
class StepResult:
    name: str
    title: str
    status: str = PASS
    reason: str = ""  # why it was skipped or failed; empty when it passed
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        """One line for the console and the report: 'skipped: no CUDA device', 'pass', ..."""
        return f"{self.status}: {self.reason}" if self.reason else self.status

    def finish(self) -> "StepResult":
        """Sets the status from the figures: fail when any failed."""
        failed = [f.name for f in self.figures if f.status == FAIL]
        if failed and self.status == PASS:
            self.status, self.reason = FAIL, "failed: " + ", ".join(failed)
        return self


def skipped(name: str, title: str, reason: str) -> StepResult:
    return StepResult(name, title, SKIPPED, reason)


def exit_code(steps: list[StepResult]) -> int:
    """0 when everything that ran passed (skips alone are fine), 1 when anything failed."""
    return 1 if any(s.status == FAIL for s in steps) else 0


def to_json(environment: dict[str, Any], steps: list[StepResult]) -> dict[str, Any]:
    return {
        "environment": environment,
        "exit_code": exit_code(steps),
        "steps": [{**asdict(s), "line": s.line} for s in steps],
    }


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def to_markdown(environment: dict[str, Any], steps: list[StepResult]) -> str:
    lines = ["# smp GPU check", ""]
    lines += [f"- **{k}**: {_value(v)}" for k, v in environment.items()]
    lines += ["", f"Exit code: {exit_code(steps)}", ""]
    for s in steps:
        lines += [f"## {s.title} (`{s.name}`): {s.line}", ""]
        lines += [f"- {n}" for n in s.notes]
        if s.notes:
            lines.append("")
        if s.figures:
            lines += ["| figure | value | unit | goal | status | reason |", "|---|---|---|---|---|---|"]
            for f in s.figures:
                lines.append(f"| {f.name} | {_value(f.value)} | {f.unit} | {f.goal} | {f.status} | {f.reason} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def write(out_dir: str, environment: dict[str, Any], steps: list[StepResult]) -> tuple[str, str]:
    """gpu_check_report.json and gpu_check_report.md in `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "gpu_check_report.json")
    md_path = os.path.join(out_dir, "gpu_check_report.md")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(to_json(environment, steps), f, indent=2, default=str)
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(to_markdown(environment, steps))
    return json_path, md_path
