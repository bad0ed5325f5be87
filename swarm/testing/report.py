"""The report of a scenario run: figures computed from its events (JSON) and a PNG timeline of
loss, collective steps, throughput and faults (matplotlib, the `lab` extra)."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any


def _series(events: list[dict[str, Any]], kind: str, key: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e["kind"] == kind and isinstance(e.get(key), int | float) and e[key] == e[key]:
            out.setdefault(e["proc"], []).append((e["t"], float(e[key])))
    return out


def fault_spans(events: list[dict[str, Any]], end: float) -> list[tuple[float, float, str]]:
    """(start, end, description) of every fault; a fault with no end lasts an instant."""
    opened: dict[int, tuple[float, str]] = {}
    spans = []
    for e in events:
        if e["kind"] == "fault":
            opened[e["id"]] = (e["t"], e["fault"])
        elif e["kind"] == "fault_end" and e["id"] in opened:
            t0, what = opened.pop(e["id"])
            spans.append((t0, e["t"], what))
    spans += [(t0, t0, what) for t0, what in opened.values()]
    return sorted(spans)


def longest_stall(epochs: list[tuple[float, float]], until: float | None = None) -> tuple[float, float]:
    """(longest time the swarm's epoch did not grow, median time per collective step), counted from
    the first collective step to `until` (default: the last report): a swarm that stops stepping
    while its trainers still train has stalled until then; both NaN without two steps."""
    times = []
    best = -1.0
    for t, epoch in sorted(epochs):
        if epoch > best:
            times.append(t)
            best = epoch
    if len(times) < 3:
        return float("nan"), float("nan")
    end = max(t for t, _ in epochs) if until is None else until
    gaps = [b - a for a, b in itertools.pairwise([*times[1:], max(end, times[-1])])] or [float("nan")]
    first_epoch = min(e for _, e in epochs)
    steps = max(best - first_epoch, 1)
    return max(gaps), (times[-1] - times[0]) / steps


def digest_agreement(events: list[dict[str, Any]], after: float) -> dict[str, Any]:
    """Whether the trainers hold bit-identical shared parameters after time `after` (the last heal).

    The demo trainer prints a `digest` event (sha256 of its shared parameters) each time its epoch
    changes. Checked: every epoch reported after `after` by more than one trainer has one digest
    (`mismatched` lists those that do not), and the trainers that trained after `after` (progress
    events) reached a common epoch whose digest every one of them reported (`common_epoch`, the
    last such; None if there is none)."""
    reported: dict[int, dict[str, str]] = {}
    for e in events:
        if e["kind"] == "digest" and e["t"] > after:
            reported.setdefault(int(e["epoch"]), {})[e["proc"]] = e["sha256"]
    trainers = sorted({e["proc"] for e in events if e["kind"] == "progress" and e["t"] > after})
    mismatched = {epoch: procs for epoch, procs in sorted(reported.items()) if len(set(procs.values())) > 1}
    common = [epoch for epoch, procs in reported.items() if trainers and set(trainers) <= set(procs)]
    return {
        "after_s": after,
        "trainers": trainers,
        "epochs_compared": sum(1 for procs in reported.values() if len(procs) > 1),
        "mismatched": mismatched,
        "common_epoch": max(common, default=None),
    }


def figures(events: list[dict[str, Any]], relay: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the run measured, per trainer and for the swarm."""
    end = max((e["t"] for e in events), default=0.0)
    trainers: dict[str, Any] = {}
    for e in events:
        if e["kind"] == "progress":
            trainers[e["proc"]] = {k: e[k] for k in ("epoch", "samples", "averaging_bytes", "expert_bytes", "step")
                                   if k in e}
    for proc, evals in _series(events, "eval", "loss").items():
        trainers.setdefault(proc, {})["held_out_loss"] = evals[-1][1]
        trainers[proc]["held_out_first"] = evals[0][1]
    rates = _series(events, "progress", "samples_per_second")
    for proc, points in rates.items():
        trainers.setdefault(proc, {})["samples_per_second_median"] = statistics.median(v for _, v in points)
    swarm_epochs = [(t, v) for pts in _series(events, "progress", "epoch").values() for t, v in pts]
    exits = [e for e in events if e["kind"] == "exit"]
    # until the first trainer leaves for good (the swarm winds down from there), or the last report
    trainer_exits = [e["t"] for e in exits if e.get("proc") in trainers and not e.get("killed")]
    stall, step_time = longest_stall(swarm_epochs, min(trainer_exits, default=None) if trainer_exits else None)
    return {
        "seconds": end,
        "trainers": trainers,
        "collective_steps": max((t.get("epoch", 0) for t in trainers.values()), default=0),
        "samples": sum(t.get("samples", 0) for t in trainers.values()),
        "longest_stall_s": stall,
        "median_step_s": step_time,
        "faults": [{"start": a, "end": b, "fault": w} for a, b, w in fault_spans(events, end)],
        "digests": digest_agreement(events, max((b for _, b, _ in fault_spans(events, end)), default=0.0)),
        "crashes": [e for e in exits if e["code"] not in (0, None) and not e.get("killed")],
        "relay": relay or {},
    }


def timeline_png(events: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Draws loss, collective steps, throughput and faults against time; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    end = max((e["t"] for e in events), default=1.0)
    panels = [("loss (nats/byte)", _series(events, "progress", "loss")),
              ("collective steps (epoch)", _series(events, "progress", "epoch")),
              ("samples/s", _series(events, "progress", "samples_per_second"))]
    fig, axes = plt.subplots(len(panels) + 1, 1, figsize=(11, 9), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 2, 1.5]})
    spans = fault_spans(events, end)
    evals = _series(events, "eval", "loss")
    for ax, (label, series) in zip(axes, panels, strict=False):
        for proc, points in sorted(series.items()):
            ax.plot([t for t, _ in points], [v for _, v in points], label=proc, linewidth=1.2)
        if label.startswith("loss"):
            for proc, points in sorted(evals.items()):
                ax.scatter([t for t, _ in points], [v for _, v in points], s=12, marker="o", label=f"{proc} held-out")
        for a, b, _ in spans:
            ax.axvspan(a, max(b, a + end / 400), color="tab:red", alpha=0.12)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if any(panels[0][1].values()):
        axes[0].legend(fontsize=7, ncol=4, loc="upper right")
    lanes = axes[-1]
    kinds = sorted({w.split()[0] for _, _, w in spans})
    for a, b, what in spans:
        y = kinds.index(what.split()[0])
        lanes.barh(y, max(b - a, end / 400), left=a, height=0.6, color="tab:red", alpha=0.6)
        lanes.text(a, y + 0.35, what.split(" for ")[0], fontsize=6)
    lanes.set_yticks(range(len(kinds)), kinds)
    lanes.set_xlabel("time (s)")
    lanes.set_ylabel("faults")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(events: list[dict[str, Any]], out_dir: Path, title: str, relay: dict[str, Any] | None = None,
          extra: dict[str, Any] | None = None) -> tuple[Path, Path | None]:
    """Writes report.json (figures and events) and timeline.png into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"scenario": title, "figures": {**figures(events, relay), **(extra or {})}, "events": events}
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    return json_path, timeline_png(events, out_dir / "timeline.png", title)
