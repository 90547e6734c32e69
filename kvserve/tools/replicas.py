"""`kvserve plan --rate ...`: how many replicas a traffic mix needs, and what prefix-aware routing saves.

One replica is one engine on `num_gpus` GPUs (tensor parallel). Its ceilings come from the same
formulas as `kvserve plan` (tools/plan.py, kv/sizing.py): decode is bandwidth bound at the largest
batch that fits, prefill compute bound at 2 FLOPs per active parameter per prompt token. Requests
share `num_prefixes` prefixes (system prompts) of `shared_prefix_fraction` of their prompt, equally
often. A prefix hit skips those tokens' prefill. Round-robin and least-loaded routing show every
prefix to every replica; prefix-aware routing shows each replica only its share of the prefixes,
so more of them stay cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.tools.plan import Plan, format_table, human_bytes, plan
from kvserve.tools.presets import Hardware, ModelShape

DEFAULT_MAX_BATCH = 256          # vLLM's max_num_seqs
DEFAULT_MAX_UTILIZATION = 0.8    # busy share of a replica's time we plan for
MAX_REPLICAS = 100_000


@dataclass(frozen=True)
class Traffic:
    """The traffic mix: requests per second, tokens per request, how much of the prompt is shared."""

    rate: float
    prompt_tokens: int
    output_tokens: int
    shared_prefix_fraction: float = 0.0
    num_prefixes: int = 1

    def check(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"--rate must be a positive number of requests per second, got {self.rate}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("--prompt-tokens and --output-tokens must be at least 1")
        if not 0 <= self.shared_prefix_fraction <= 1:
            raise ValueError(f"--shared-prefix must be a fraction in [0, 1], got {self.shared_prefix_fraction}")
        if self.num_prefixes < 1:
            raise ValueError(f"--num-prefixes must be at least 1, got {self.num_prefixes}")

    @property
    def prefix_tokens(self) -> int:
        return round(self.shared_prefix_fraction * self.prompt_tokens)


@dataclass
class PolicyPlan:
    """One routing policy at a replica count: hit rate, prefill per request, busy share, TTFT floor."""

    policy: str
    replicas: int
    prefix_hit_rate: float
    prefill_tokens_per_request: float
    utilization: float
    ttft_s: float


@dataclass
class ReplicaPlan:
    """The replica plan: one replica's ceilings, each policy's replica count and the savings."""

    traffic: Traffic
    replica: Plan                     # one replica at context prompt + output, at the decode batch
    decode_batch: int
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    request_seconds: float            # one request's prefill + decode, unloaded: residence time
    max_utilization: float
    round_robin: PolicyPlan           # also least-loaded: both show every prefix to every replica
    prefix: PolicyPlan
    prefix_at_round_robin: PolicyPlan  # prefix-aware on round-robin's replica count
    prefill_tokens_avoided_per_s: float
    assumptions: list[str] = field(default_factory=list)


def plan_replicas(model: ModelShape, traffic: Traffic, gpu: Hardware, max_batch: int = DEFAULT_MAX_BATCH,
                  max_utilization: float = DEFAULT_MAX_UTILIZATION, **plan_args) -> ReplicaPlan:
    """Replicas needed for `traffic` under round-robin and prefix-aware routing (plan_args: plan()'s)."""
    traffic.check()
    if not 0 < max_utilization <= 1:
        raise ValueError(f"--max-utilization must be in (0, 1], got {max_utilization}")
    if max_batch < 1:
        raise ValueError(f"--max-batch must be at least 1, got {max_batch}")
    if gpu.flops <= 0:
        raise ValueError(f"hardware {gpu.name} has no compute figure; give --tflops")
    context = traffic.prompt_tokens + traffic.output_tokens
    batch = min(plan(model, context=context, gpu=gpu, **plan_args).max_concurrent_sequences, max_batch)
    if batch < 1:
        raise ValueError(f"not one sequence of {context} tokens fits a replica's KV budget; add GPUs "
                         "per replica (--num-gpus) or shorten the requests")
    one = plan(model, context=context, batch=batch, gpu=gpu, **plan_args)
    m = _Model(traffic, one, batch, prefill_tokens_per_s(model, gpu, one.num_gpus), max_utilization)
    rr = m.fewest_replicas(prefix_aware=False)
    result = ReplicaPlan(
        traffic=traffic, replica=one, decode_batch=batch, decode_tokens_per_s=m.decode_rate,
        prefill_tokens_per_s=m.prefill_rate, request_seconds=m.residence, max_utilization=max_utilization,
        round_robin=rr, prefix=m.fewest_replicas(prefix_aware=True),
        prefix_at_round_robin=m.at(rr.replicas, prefix_aware=True),
        prefill_tokens_avoided_per_s=0.0)
    result.prefill_tokens_avoided_per_s = traffic.rate * (
        rr.prefill_tokens_per_request - result.prefix_at_round_robin.prefill_tokens_per_request)
    result.assumptions = assumptions(result, model)
    return result


def prefill_tokens_per_s(model: ModelShape, gpu: Hardware, num_gpus: int) -> float:
    """Compute-bound prefill ceiling of one replica: its FLOP/s over 2 FLOPs per active parameter."""
    active = model.active_params or model.num_params
    if not active:
        raise ValueError(f"{model.name} has no parameter count; give --params")
    return num_gpus * gpu.flops / (2 * active)


class _Model:
    """The formulas of one traffic mix on one replica shape."""

    def __init__(self, traffic: Traffic, one: Plan, batch: int, prefill_rate: float, max_utilization: float):
        self.t, self.one, self.batch = traffic, one, batch
        self.prefill_rate = prefill_rate
        self.decode_rate = one.tokens_per_s_ceiling
        self.max_utilization = max_utilization
        # residence time of a request with no hit: prefill, then one decode step per output token
        self.residence = traffic.prompt_tokens / prefill_rate + traffic.output_tokens * one.time_per_output_token_s

    def fewest_replicas(self, prefix_aware: bool) -> PolicyPlan:
        """The smallest replica count whose utilization stays within max_utilization."""
        for replicas in range(1, MAX_REPLICAS + 1):
            p = self.at(replicas, prefix_aware)
            if p.utilization <= self.max_utilization:
                return p
        raise ValueError(f"more than {MAX_REPLICAS} replicas needed; check --rate")

    def at(self, replicas: int, prefix_aware: bool) -> PolicyPlan:
        """One policy at `replicas` replicas."""
        hit = self.hit_rate(replicas, prefix_aware)
        prefill = self.t.prompt_tokens - hit * self.t.prefix_tokens
        busy = prefill / self.prefill_rate + self.t.output_tokens / self.decode_rate
        return PolicyPlan("prefix" if prefix_aware else "round-robin", replicas, hit, prefill,
                          self.t.rate / replicas * busy, prefill / self.prefill_rate)

    def hit_rate(self, replicas: int, prefix_aware: bool) -> float:
        """Share of requests whose shared prefix is cached on the replica they reach."""
        if not self.t.prefix_tokens:
            return 0.0
        seen = math.ceil(self.t.num_prefixes / replicas) if prefix_aware else self.t.num_prefixes
        return min(1.0, self.prefixes_kept(replicas) / seen)

    def prefixes_kept(self, replicas: int) -> int:
        """Shared prefixes one replica's KV budget keeps beside its in-flight requests' own tokens."""
        in_flight = min(self.batch, math.ceil(self.t.rate / replicas * self.residence))  # Little's law
        own_tokens = self.t.prompt_tokens - self.t.prefix_tokens + self.t.output_tokens
        per_token = self.one.kv_bytes_per_token
        room = self.one.kv_budget_bytes - in_flight * own_tokens * per_token
        return max(0, room // (self.t.prefix_tokens * per_token))


def assumptions(r: ReplicaPlan, model: ModelShape) -> list[str]:
    """What the numbers take for granted, in words."""
    t = r.traffic
    return [
        f"a replica decodes at batch {r.decode_batch} (the most sequences of {t.prompt_tokens + t.output_tokens} "
        f"tokens that fit, at most --max-batch), bandwidth bound: {r.decode_tokens_per_s:,.0f} tokens/s",
        f"prefill is compute bound at 2 FLOPs per active parameter per token (attention FLOPs left out), at "
        f"the peak {r.replica.num_gpus} x {r.replica.gpu} give: {r.prefill_tokens_per_s:,.0f} tokens/s",
        "prefill and decode share a replica's time (chunked prefill); replicas are added until each is busy "
        f"at most {r.max_utilization:.0%} of the time",
        f"{t.num_prefixes} shared prefix(es) of {t.prefix_tokens} tokens, each asked equally often; a replica "
        "keeps as many as its KV budget holds beside its in-flight requests (Little's law at the unloaded "
        f"residence time, {r.request_seconds * 1e3:.0f} ms), a request hits when its prefix is kept",
        "round-robin and least-loaded show every prefix to every replica; prefix-aware routing gives each "
        "replica its own share (first misses, load imbalance and tier hits left out)",
        "TTFT is the prefill time alone (no queueing): a floor, not a forecast",
    ]


def format_replica_plan(r: ReplicaPlan) -> str:
    """The readable report of a replica plan."""
    t, one = r.traffic, r.replica
    title = (f"{one.model} replicas on {one.num_gpus} x {one.gpu} each: {t.rate:g} requests/s, prompt "
             f"{t.prompt_tokens:,} (shared prefix {t.prefix_tokens:,}, {t.num_prefixes} prefix(es)), "
             f"output {t.output_tokens:,}, KV {one.kv_format}")
    header = ["routing", "replicas", "GPUs", "prefix hits", "prefill/request", "busy", "TTFT floor"]
    rows = [_policy_row(p, one.num_gpus) for p in (r.round_robin, r.prefix)]
    rows[0][0] = "round-robin, least-loaded"
    if r.prefix.replicas != r.round_robin.replicas:
        rows.append(_policy_row(r.prefix_at_round_robin, one.num_gpus))
        rows[2][0] = "prefix, same replicas"
    saved = r.round_robin.replicas - r.prefix.replicas
    summary = [
        f"one replica: KV budget {human_bytes(max(one.kv_budget_bytes, 0))} per GPU, decode batch {r.decode_batch}, "
        f"<= {r.decode_tokens_per_s:,.0f} decode tokens/s, <= {r.prefill_tokens_per_s:,.0f} prefill tokens/s",
        f"prefix-aware routing: {saved} replica(s) fewer; on {r.round_robin.replicas} replicas it avoids "
        f"{r.prefill_tokens_avoided_per_s:,.0f} prefill tokens/s and takes the TTFT floor from "
        f"{r.round_robin.ttft_s * 1e3:.3g} to {r.prefix_at_round_robin.ttft_s * 1e3:.3g} ms",
    ]
    notes = "\n".join(f"  - {a}" for a in r.assumptions)
    return "\n".join([title, format_table(rows, header), *summary, "assumptions:", notes])


def _policy_row(p: PolicyPlan, gpus: int) -> list[str]:
    return [p.policy, str(p.replicas), str(p.replicas * gpus), f"{p.prefix_hit_rate:.0%}",
            f"{p.prefill_tokens_per_request:,.0f} tokens", f"{p.utilization:.0%}", f"{p.ttft_s * 1e3:.3g} ms"]
