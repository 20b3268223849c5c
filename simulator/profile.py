"""Replica profiles: what one replica can hold (KV blocks, sequences, the step's token budget) and
how long one engine step takes (Vidur's approach: a step-time model fitted on measured steps).

    step time = base + compute(batched tokens) + per_kv_token x KV tokens read
                + per_seq x sequences in the step
                + allreduce + allreduce_per_token x batched tokens   (tensor parallelism only)

where compute(n) is either the roofline `max(weights, per_token x n)` (`weights` is the time to
stream the weights once: decode is memory-bound until the batch's compute exceeds it) or, when
the profile has one, a measured `token_curve`: (batched tokens, seconds) points interpolated
linearly, extended past the last point at `per_token` per token. A measured curve keeps what no
two-term formula does: on a CPU a decode step of 2 sequences costs 1.6x one of 1 (a matrix-vector
product becomes a matrix product), then grows slowly. Shipped profiles live in profiles/*.json:
`cpu-embedded` (fitted on the CPU engine with the embedded model, benchmarks/fit_cpu_profile.py)
and `h100-llama3-8b` (from the H100 roofline of an 8B model; to be replaced by measured steps),
and `h100-{llama3-8b,llama3-70b}-tp{2,4,8}`, replicas of N GPUs derived by roofline.py. A profile's
`gpus` is what one replica costs in GPU-hours an hour."""

from __future__ import annotations

import bisect
import itertools
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

PROFILES_DIR = Path(__file__).with_name("profiles")
# The largest profile file read (a shipped one is a few kB; a measured token curve a few more).
MAX_PROFILE_BYTES = 1 << 20


@dataclass(frozen=True)
class StepModel:
    base_s: float
    per_token_s: float
    per_kv_token_s: float
    per_seq_s: float
    weights_s: float = 0.0
    token_curve: tuple[tuple[int, float], ...] = ()
    # Tensor parallelism's all-reduces, which wait for the compute and are waited for (roofline.py).
    allreduce_s: float = 0.0
    allreduce_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        curve = tuple((int(n), float(s)) for n, s in self.token_curve)
        if any(b[0] <= a[0] for a, b in itertools.pairwise(curve)):
            raise ValueError("token_curve: batched-token counts must increase")
        object.__setattr__(self, "token_curve", curve)

    def compute_time(self, batched_tokens: int) -> float:
        curve = self.token_curve
        if not curve:
            return max(self.weights_s, self.per_token_s * batched_tokens)
        if batched_tokens <= curve[0][0]:
            return curve[0][1]
        if batched_tokens >= curve[-1][0]:
            return curve[-1][1] + self.per_token_s * (batched_tokens - curve[-1][0])
        upper = bisect.bisect_left(curve, (batched_tokens, -math.inf))
        (n0, s0), (n1, s1) = curve[upper - 1], curve[upper]
        return s0 + (s1 - s0) * (batched_tokens - n0) / (n1 - n0)

    def allreduce_time(self, batched_tokens: int) -> float:
        return self.allreduce_s + self.allreduce_per_token_s * batched_tokens

    def step_time(self, batched_tokens: int, kv_tokens: int, num_seqs: int) -> float:
        device = self.compute_time(batched_tokens) + self.allreduce_time(batched_tokens)
        return self.base_s + device + self.per_kv_token_s * kv_tokens + self.per_seq_s * num_seqs


@dataclass(frozen=True)
class ReplicaProfile:
    name: str
    description: str
    step: StepModel
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    cold_start_s: float = 120.0  # pod creation to Ready (pull cached, model load, warm-up)
    gpus: int = 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> ReplicaProfile:
        """A profile from its JSON object; ValueError naming the field for anything else."""
        if not isinstance(data, dict):
            raise ValueError("a profile is a JSON object")
        _check_fields(data, cls, "")
        if not isinstance(data["step"], dict):
            raise ValueError("step: must be an object")
        _check_fields(data["step"], StepModel, "step.")
        try:
            return cls(**{**data, "step": StepModel(**data["step"])})
        except (TypeError, ValueError) as exc:  # token_curve points that are not [tokens, seconds]
            raise ValueError(f"step.token_curve: {exc}") from None


def _check_fields(data: dict[str, Any], cls: type, where: str) -> None:
    """Every field known and required ones present; numbers positive where the model divides by
    them (counts) or non-negative (seconds)."""
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown profile field(s): {', '.join(where + name for name in unknown)}")
    missing = [name for name, f in known.items() if f.default is MISSING and name not in data]
    if missing:
        raise ValueError(f"missing profile field(s): {', '.join(where + name for name in missing)}")
    for name, value in data.items():
        kind = known[name].type
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}{name}: must be a positive integer, got {value!r}")
        if kind == "float" and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf
        ):
            raise ValueError(f"{where}{name}: must be a non-negative number, got {value!r}")
        if kind == "str" and not isinstance(value, str):
            raise ValueError(f"{where}{name}: must be a string, got {value!r}")


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> ReplicaProfile:
    """A shipped profile by name, or a profile JSON file; ValueError naming the file and the problem."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(f"no profile {name_or_path!r}: a file, or one of {', '.join(shipped_profiles())}")
    try:
        with path.open("rb") as handle:
            text = handle.read(MAX_PROFILE_BYTES + 1)
        if len(text) > MAX_PROFILE_BYTES:
            raise ValueError(f"{name_or_path}: larger than {MAX_PROFILE_BYTES >> 20} MiB: too large to read")
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"{name_or_path}: nested too deeply to be read") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{name_or_path}: not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name_or_path}: not UTF-8 text ({exc.reason})") from None
    try:
        return ReplicaProfile.from_json(data)
    except ValueError as exc:
        raise ValueError(f"{name_or_path}: {exc}") from None
