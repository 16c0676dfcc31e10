"""Console logs: LeRobot's `lerobot-train` (and logs that capture it, the case study's summary lines
included) and pi0align's recipe log. LeRobot prints the count of updates done, so its `step:5` is
pi0align's step 4, and the value it prints there is the mean over its log window (its
`MetricsTracker` averages every `log_freq` steps): such a record carries `window` (the steps it
averages, ending at `step`) and `loss_resolution` (half a unit of the last printed digit). The
config it prints is read as a literal: nothing in a log is evaluated."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from pi0align.errors import UserError
from pi0align.runs.logs.lerobot_config import is_lerobot_config, lerobot_manifest
from pi0align.runs.logs.records import Log, check_order, lines, parse_number

# the metrics LeRobot's tracker prints, by the names pi0align's log gives them
LEROBOT_METRICS = {"loss": "loss", "grdn": "grad_norm", "lr": "lr", "updt_s": "step_time_s", "data_s": "data_time_s"}
_LEROBOT_STEP = re.compile(r"\bstep:(\d+(?:\.\d+)?[KMBTQ]?) smpl:\S+ ep:\S+ epch:\S+((?: \w+:\S+)+)")
_RECIPE_STEP = re.compile(r"\bstep (\d+) loss (\S+) grad_norm (\S+) lr (\S+)")
_SUMMARY = {"images_per_sec": re.compile(r"Final Performance images/sec: (\S+)"),
            "final_loss": re.compile(r"Final Train Loss: (\S+)"),
            "e2e_seconds": re.compile(r"E2E Training Duration sec: (\S+)")}
_CONFIG_START = re.compile(r"\.py:\d+ (\{')")  # the logging prefix, then the printed config's first key
_NOT_LITERAL = re.compile(r"<[\w.]+: ('[^']*'|[^<>]*)>|\b\w*Path\(('[^']*')\)")  # enums and paths, as reprs
_LOG_FREQ = re.compile(r"'log_freq': (\d+)")
_SUFFIXES = "KMBTQ"
_MAX_CONFIG_LINES = 5000  # LeRobot's printed config: a few hundred lines


def _resolution(text: str) -> float:
    """Half a unit of the last digit printed (0.741: 5e-4); 0 for a number printed in full."""
    if "e" in text.lower() or "." not in text:
        return 0.0
    decimals = len(text.split(".")[1])
    return 0.0 if decimals >= 9 else 0.5 * 10.0 ** -decimals


def _big_number(value: float, suffix: int) -> str:
    """LeRobot's format_big_number(precision=0) of a count, as it prints steps."""
    for _ in range(suffix):
        value /= 1000.0
    return f"{value:.0f}{_SUFFIXES[suffix - 1] if suffix else ''}"


def read_console_log(path: Path) -> Log | None:
    """LeRobot's console log (or pi0align's recipe log): its step lines, summary lines and printed
    config; None when no line is a step line of either (another kind of file), in one pass."""
    printed: list[tuple[int, str, dict[str, str]]] = []  # line number, step as printed, metrics
    recipe: list[tuple[int, list[str]]] = []
    summary: dict[str, Any] = {}
    config_text: list[str] | None = None
    config: dict[str, Any] | None = None
    log_freq: int | None = None
    for number, line in enumerate(lines(path), start=1):
        if config is None and config_text is None and (start := _CONFIG_START.search(line)):
            config_text = [line[start.start(1):]]
        elif config_text is not None:
            config_text.append(line)
        if config_text is not None:
            config = _literal_config(config_text)
            if config is not None or len(config_text) > _MAX_CONFIG_LINES:
                config_text = None
        if log_freq is None and (match := _LOG_FREQ.search(line)):
            log_freq = int(match.group(1))
        if match := _LEROBOT_STEP.search(line):
            printed.append((number, match.group(1), dict(m.split(":", 1) for m in match.group(2).split())))
        elif match := _RECIPE_STEP.search(line):
            recipe.append((number, list(match.groups())))
        for key, pattern in _SUMMARY.items():
            if match := pattern.search(line):
                summary[key] = parse_number(match.group(1), path, number)
    if not (printed or recipe):
        return None
    if printed:
        records = _lerobot_records(path, printed, log_freq)
        kind = "lerobot-train console log"
    else:
        records = [{"step": int(step), "loss": parse_number(loss, path, n), "grad_norm": parse_number(grad, path, n),
                    "lr": parse_number(lr, path, n), "loss_resolution": _resolution(loss)}
                   for n, (step, loss, grad, lr) in recipe]
        kind = "pi0align recipe log"
    check_order(path, records)
    manifest = lerobot_manifest(config) if config else {}
    return Log(kind=kind, records=records, summary=summary, manifest=manifest)


def _literal_config(lines: list[str]) -> dict[str, Any] | None:
    """The config LeRobot printed (pformat of a dict), once its lines are all there; a literal
    only (ast.literal_eval runs nothing)."""
    text = "".join(lines)
    if text.count("{") > text.count("}"):
        return None
    text = _NOT_LITERAL.sub(lambda match: match.group(1) or match.group(2), text[:text.rindex("}") + 1])
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return {}
    return value if is_lerobot_config(value) else {}


def _lerobot_records(path: Path, printed: list[tuple[int, str, dict[str, str]]], log_freq: int | None) -> list[dict]:
    """Records of LeRobot's step lines, steps made exact (exact_steps), values by pi0align's names."""
    records = []
    counts, log_freq = _exact_steps(path, printed, log_freq)
    for (number, _, metrics), done in zip(printed, counts):
        record: dict[str, Any] = {"step": done - 1, "window": min(log_freq, done)}
        for name, value in metrics.items():
            if name in LEROBOT_METRICS:
                record[LEROBOT_METRICS[name]] = parse_number(value, path, number)
        if "loss" not in record:
            raise UserError(f"{path}:{number}: a step line without a loss")
        record["loss_resolution"] = _resolution(metrics["loss"])
        records.append(record)
    return records


def _exact_steps(path: Path, printed: list[tuple[int, str, dict[str, str]]],
                 log_freq: int | None) -> tuple[list[int], int]:
    """The update counts LeRobot printed (1K for 1,000 to 1,499: its format_big_number) made exact,
    and the log's frequency.
    It logs every `log_freq` updates (its printed config's, else the smallest gap between counts
    printed in full), so each line's count is the previous one's plus log_freq; the first, where it
    is printed in thousands, is the one multiple of log_freq that the lines after it agree with."""
    texts = [text for _, text, _ in printed]
    exact = [int(text) for text in texts if text.isdigit()]
    if log_freq is None:
        gaps = [b - a for a, b in zip(exact, exact[1:]) if b > a]
        log_freq = min(gaps) if gaps else (exact[0] if exact else None)
    if not log_freq:
        raise UserError(f"{path}: cannot tell its steps: every step line counts in thousands and its log_freq "
                        "is not printed (give the log from its first step)")
    starts = [int(texts[0])] if texts[0].isdigit() else _multiples_printed_as(texts[0], log_freq)
    fitting = [start for start in starts if all(
        text == (str(count) if text.isdigit() else _big_number(count, _SUFFIXES.index(text[-1]) + 1))
        for text, count in zip(texts, range(start, start + log_freq * len(texts), log_freq)))]
    if len(fitting) != 1:
        number = printed[0][0]
        raise UserError(f"{path}:{number}: cannot tell the steps from the one printed as {texts[0]} on (log_freq "
                        f"{log_freq}: {'several counts fit' if fitting else 'no count every log_freq steps fits'})")
    return list(range(fitting[0], fitting[0] + log_freq * len(texts), log_freq)), log_freq


def _multiples_printed_as(text: str, log_freq: int) -> list[int]:
    """The multiples of log_freq that LeRobot prints as `text` (2K: 1,500 to 2,500)."""
    suffix = _SUFFIXES.index(text[-1]) + 1
    unit = 1000 ** suffix
    value = float(text[:-1])
    low, high = int((value - 0.5) * unit), int((value + 0.5) * unit) + 1
    return [count for count in range(low - low % log_freq, high + 1, log_freq)
            if count > 0 and _big_number(count, suffix) == text]
