"""The step-time model: what a record's step costs at a host's rates, one formula for the runs
and the planner. A run records the work of its step (`work`: common.step_work's FLOPs, token
layers, parameters stepped, collectives by op and group, which of them the technique overlaps,
its bubble); the report prices it here as it reads the record (`priced`), at the calibration
its `make` target took before it (calibration_for), so that an optimized run and its baseline
are priced alike, and a record is priced again when the model changes. The parts: compute
(FLOPs over the rate achieved at the workload's shapes, a forward more where activations are
recomputed; the rest of the ops per token and layer), the optimizer's step, each collective's
latency and bytes less what the technique hides under compute, and a pipeline's bubble. `make
calibrate` (report/calibrate.py) measures this host's rates, and the spread of each over its
repeats (`rates_band`); report/gpus.py gives a GPU's from its datasheet.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import common

CALIBRATION = common.ROOT / "outputs" / "calibration.json"
# The compute a collective can hide under, as a fraction of the step's compute: DDP's buckets
# and ZeRO-2's reduce-scatters go out as backward (2/3 of the FLOPs) makes gradients; FSDP's
# prefetched gathers and its reduce-scatters span forward and backward; an offloaded
# optimizer's host step runs under the next forward (1/3).
OVERLAP_WINDOWS = {"backward": 2 / 3, "forward": 1 / 3, "step": 1.0}


@dataclass(frozen=True)
class Rates:
    """What a step's parts cost on one host or GPU: the achieved matmul and attention FLOP/s
    (one process's, with the host's other processes busy too), the rest of the ops a token and
    layer, the optimizer's step a parameter, each collective's (op, group size): seconds a
    message and a byte sent; and the fraction of a collective's time that compute hides when
    the two run at once."""

    matmul_flops: float
    attention_flops: float  # at any length, unless attention_by_length says otherwise
    other_s: float  # a token and layer: norms, activations, residuals, the loss, autograd
    optimizer_s: float  # a parameter the optimizer steps (AdamW)
    links: Mapping[str, tuple[float, float]]  # "allreduce/2" -> (s a message, s a byte sent)
    overlap: float
    source: str  # which calibration or datasheet
    layer_s: float = 0.0  # a layer's forward and backward whatever its tokens: op dispatch
    attention_by_length: tuple[tuple[int, float], ...] = ()  # (sequence length, FLOP/s)
    float8_matmul_flops: float = 0.0  # torchao's Float8Linear; 0: not measured (matmul_flops)

    def attention_rate(self, seq: int) -> float:
        """Attention's FLOP/s at sequence length `seq`: between two lengths measured, linear in
        log length; past the ends, the nearest end's (a longer sequence's kernel does not
        slow down; a shorter one's is the shortest measured)."""
        points = sorted(self.attention_by_length)
        if not points:
            return self.attention_flops
        if seq <= points[0][0]:
            return points[0][1]
        for (short, low), (long, high) in itertools.pairwise(points):
            if seq <= long:
                return low + (high - low) * math.log(seq / short) / math.log(long / short)
        return points[-1][1]

    def link(self, key: str) -> tuple[float, float]:
        """(latency, s a byte) of a collective "op/group": measured at that group size, else
        at the nearest group measured, else the nearest group's all-reduce (each collective
        a ring's steps). A GPU's links are named by mesh dim and where they run instead
        ("dp/network")."""
        if key in self.links:
            return self.links[key]
        op, group = key.split("/")
        if group == "1":  # a group of one sends nothing (a world of one's DDP, say)
            return 0.0, 0.0
        measured = [k for k in self.links if k.split("/")[0] == op] or \
            [k for k in self.links if k.startswith("allreduce/")]
        if not group.isdigit() or not measured:
            raise KeyError(f"{self.source} has no link for {key!r}; it has {sorted(self.links)}")
        return self.links[min(measured, key=lambda k: abs(int(k.split("/")[1]) - int(group)))]


def rates_from_calibration(calibration: Mapping, world: int, model: str) -> Rates | None:
    """This host's Rates for a world of `world` processes and `model`, from one size's entry of
    outputs/calibration.json, measured at that world; None where it has none."""
    measured = calibration.get("worlds", {}).get(str(world))
    if not measured or "layer_s" not in measured["compute"].get(model, {}):
        return None  # not measured here, or by an older `make calibrate`
    compute = measured["compute"][model]
    return Rates(compute["matmul_flops"], compute["attention_flops"], compute["other_s"],
                 measured["optimizer_s"], {key: tuple(value) for key, value in
                                           measured["collectives"].items()},
                 measured["overlap"], calibration["id"], compute["layer_s"],
                 tuple((int(seq), rate) for seq, rate in compute["attention_by_length"]),
                 compute.get("float8_matmul_flops") or 0.0)
# The Rates whose larger value makes a step faster (rates, the share of a collective hidden);
# of the rest (seconds), the smaller
_FASTER_WHEN_LARGER = {"matmul_flops", "attention_flops", "overlap", "attention_by_length",
                       "float8_matmul_flops"}


def rates_band(calibration: Mapping, world: int, model: str) -> tuple[Rates, Rates] | None:
    """(fastest, slowest) Rates a calibration's band allows: each figure at the end of its
    repeats' spread that makes a step faster, then slower (each world's `band`: its lowest and
    highest repeat). None for a calibration without bands (one repeat: no spread measured)."""
    measured = calibration.get("worlds", {}).get(str(world)) or {}
    if "band" not in measured:
        return None
    ends = [rates_from_calibration({**calibration, "worlds": {str(world): {
        **measured, **measured["band"][end]}}}, world, model) for end in ("low", "high")]
    if None in ends:
        return None
    low, high = ends

    def pick(name: str, faster: bool):
        a, b = getattr(low, name), getattr(high, name)
        if name == "links":
            return {key: tuple((min if faster else max)(x, y) for x, y in zip(a[key], b[key],
                                                                                 strict=True))
                    for key in a}
        if name == "attention_by_length":
            best = max if faster else min
            return tuple((seq, best(x, y)) for (seq, x), (_, y) in zip(a, b, strict=True))
        if name == "source":
            return a
        larger = (name in _FASTER_WHEN_LARGER) == faster
        return max(a, b) if larger else min(a, b)
    return tuple(Rates(**{f.name: pick(f.name, faster) for f in dataclasses.fields(Rates)})
                 for faster in (True, False))


@dataclass(frozen=True)
class StepWork:
    """One rank's work a step, in plain numbers: FLOPs (matmul, attention in blocks of
    `seq_len` tokens: the rate it runs at), token-layers (the ops that are no matmul, by token) and
    layer passes (by layer: a pipeline's stage runs each of its layers once a micro-batch),
    recompute (activation checkpointing: the blocks' forward again), the parameters it steps,
    its collectives {"allreduce/2": (bytes sent, messages)}, which of them hide under compute
    ({"allreduce": "backward"}, OVERLAP_WINDOWS), the fraction of the step a pipeline's
    stage idles (its bubble), and the share of the matmul FLOPs in float8 linears."""

    matmul_flops: float
    attention_flops: float
    token_layers: float
    stepped_params: float
    collectives: Mapping[str, tuple[float, int]]
    overlapped: Mapping[str, str]
    recompute: bool = False
    bubble: float = 0.0
    seq_len: int = 0
    layer_passes: float = 0.0
    float8_share: float = 0.0


def predict_step(work: StepWork, rates: Rates) -> dict[str, float | str]:
    """The step's time in ms, and its parts: compute (with recompute, a third more: one forward
    of three), the optimizer, the collectives' time left exposed (less `rates.overlap` of the
    compute window each hides under), the bubble's idle time, and what binds the step (the
    largest part)."""
    float8_rate = rates.float8_matmul_flops or rates.matmul_flops
    compute = (work.matmul_flops * (1 - work.float8_share) / rates.matmul_flops
               + work.matmul_flops * work.float8_share / float8_rate
               + work.attention_flops / rates.attention_rate(work.seq_len)
               + work.token_layers * rates.other_s
               + work.layer_passes * rates.layer_s) * (4 / 3 if work.recompute else 1)
    exposed = 0.0
    for key, (sent, messages) in work.collectives.items():
        latency, per_byte = rates.link(key)
        cost = messages * latency + sent * per_byte
        window = OVERLAP_WINDOWS.get(work.overlapped.get(key.split("/")[0], ""), 0.0) * compute
        exposed += cost - rates.overlap * min(cost, window)
    bubble = compute * work.bubble / (1 - work.bubble)
    optimizer = work.stepped_params * rates.optimizer_s
    parts = {"compute": compute, "communication": exposed, "bubble": bubble,
             "optimizer": optimizer}
    return {"step_ms": 1e3 * sum(parts.values()),
            **{f"{name}_ms": 1e3 * value for name, value in parts.items()},
            "bound_by": max(parts, key=parts.get)}


def load_calibration(path: Path | None = None) -> dict | None:
    """`path`, by default CALIBRATION (outputs/calibration.json, `make calibrate`), or None
    before the first calibration."""
    path = path or CALIBRATION
    return json.loads(path.read_text()) if path.exists() else None


def work_of(rec: dict) -> StepWork | None:
    """A record's step as StepWork: its `work` (an older record's `prediction.work`), or None."""
    work = rec.get("work") or (rec.get("prediction") or {}).get("work")
    if not work:
        return None
    return StepWork(**{**work, "collectives": {op: tuple(value) for op, value in
                                               work["collectives"].items()}})


def calibrations(calibration: Mapping) -> list[dict]:
    """Every calibration a file holds: the newest of each size and those before them."""
    entries = {e["id"]: e for e in [*calibration.get("history", []),
                                    *calibration.get("sizes", {}).values()]}
    return sorted(entries.values(), key=lambda e: _when(e["time"]))


def _when(stamp: str) -> datetime.datetime:
    """A record's or calibration's time ("...Z" or "...+00:00")."""
    return datetime.datetime.fromisoformat(stamp)


def calibration_for(rec: dict, calibration: Mapping) -> dict | None:
    """The calibration a record is priced at, of those with rates for its world and model at its
    size, device and dtype: the one it names (an older record's), else the newest of its host
    and torch taken before it ran (the one its `make` run took, or reused), else the newest of
    its host at all (the record ran before any); None where its host has none."""
    device = "cpu" if rec.get("device") == "cpu" else "cuda"
    fits = [e for e in calibrations(calibration)
            if (e["size"], e["device"], e["dtype"]) == (rec.get("size"), device, rec.get("dtype"))
            and rates_from_calibration(e, rec.get("world_size"), rec.get("model"))]
    named = (rec.get("prediction") or {}).get("calibration")
    if named:
        return next((e for e in fits if e["id"] == named), None)
    own = [e for e in fits if e.get("host") == rec.get("host")]
    before = [e for e in own if e["torch"] == rec.get("torch") and rec.get("time") and
              _when(e["time"]) <= _when(rec["time"])]
    return (before or own or [None])[-1]


def calibration_covers(entry: dict, dtype: str, worlds: Sequence[int], models: Sequence[str],
                       younger_than_s: float | None = None) -> bool:
    """Whether `entry` (a size's calibration) applies: this device and dtype, every world's
    rates for every model; with `younger_than_s`, also this host and torch, taken less than
    that long ago."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if (entry.get("dtype"), entry.get("device")) != (dtype, device) or not all(
            rates_from_calibration(entry, world, model) for world in worlds for model in models):
        return False
    if younger_than_s is None:
        return True
    age = (datetime.datetime.now(datetime.UTC) - _when(entry["time"])).total_seconds()
    return (entry.get("host"), entry.get("torch")) == (platform.node(), torch.__version__) \
        and age < younger_than_s


def priced(records: list[dict], calibration: Mapping | None = None) -> list[dict]:
    """`records` with the step-time model's step for each measured one: `predicted_step_ms` and
    `prediction` (its parts, what binds it, the calibration it was priced at: calibration_for's,
    from `calibration`, by default outputs/calibration.json; `band_ms`, the step at the fastest
    and slowest rates the calibration's spread allows), or `prediction.why` where none
    applies. A record that carries no work (a failed run, a sweep) stays as it is, as does an
    older one priced as it ran whose calibration is not in `calibration`."""
    calibration = load_calibration() if calibration is None else calibration
    out = []
    for rec in records:
        if rec.get("status") != "ok" or rec.get("step_ms") is None or "sweep" in rec:
            out.append(rec)
            continue
        work, entry = work_of(rec), calibration_for(rec, calibration or {})
        if entry is None and rec.get("predicted_step_ms") is not None:
            out.append(rec)  # an older record priced as it ran, at a calibration not here
            continue
        world, size = rec.get("world_size"), rec.get("size")
        rates = entry and rates_from_calibration(entry, world, rec.get("model"))
        if work is None or rates is None:
            why = ("no cost model for the ResNet's convolutions" if rec.get("model") == "resnet"
                   else f"no calibration of {world} processes at {size} in "
                        f"{rec.get('dtype')} on this host: run make calibrate SIZE={size}")
            out.append({**rec, "predicted_step_ms": None, "prediction": {"why": why}})
            continue
        step = predict_step(work, rates)
        band = rates_band(entry, world, rec["model"])
        out.append({**rec, "predicted_step_ms": round(step.pop("step_ms"), 3),
                    "prediction": {**{k: round(v, 3) if isinstance(v, float) else v
                                      for k, v in step.items()}, "calibration": rates.source,
                                   **({"band_ms": [round(predict_step(work, r)["step_ms"], 3)
                                                   for r in band]} if band else {})}})
    return out
