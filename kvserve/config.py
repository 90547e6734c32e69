"""EngineConfig: every knob of the engine in one validated dataclass."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from kvserve.model.quant import GGUF_FORMAT, WEIGHT_FORMATS

KV_CACHE_MODES = ("paged", "contiguous", "none")
COMPILE_MODES = ("background", "blocking")   # when the model compiles (engine/compile.py)
PREEMPTION_MODES = ("recompute", "swap", "auto")   # what the scheduler does with a preempted request
SCHEDULING_POLICIES = ("fcfs", "priority")          # the order waiting requests are admitted in
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = tuple(DTYPES)
EAGER_ENV = "KVSERVE_ENFORCE_EAGER"   # =1: every engine of the process runs eagerly (model/regions.py reads it)
CPU_DEFAULT_KV_CACHE_MEMORY = 1 << 30  # like vLLM's CPU backend: a fixed KV space unless told
AUTO_GGUF_REASON = ("weights=auto on CPU: every GGUF tensor keeps its own block format (Q8_0 / Q5_* / Q6_K as exact "
                    "int8 groups, Q4_* as int4 groups: docs/WEIGHTS.md); dtype='float32' gives the float32 oracle")
# kv_cache_dtype=auto under float32 activations that dtype=auto picked on a CPU: K/V stored in
# bfloat16 (float32's exponent range, so no overflow), read and widened in place by the decode kernel.
AUTO_KV_REASON = ("kv_cache_dtype=auto under float32 activations on CPU: bfloat16 pools, half the bytes of float32 "
                  "(its quality against float32 K/V: docs/QUANTIZATION.md); kv_cache_dtype='float32' or "
                  "dtype='float32' keeps float32")
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: int | float | str) -> int:
    """Parse 1073741824, '1GiB', '512 MiB' or '2GB' into bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a byte size from {value!r}; use e.g. 1073741824, '2GiB' or '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_tier_spec(text: str):
    """'cpu:4GiB', 'disk:/path:20GiB' or 'redis://host:port/db', each optionally ending in
    ':write_through' or ':write_back' -> kvserve.kv.tiers.TierSpec."""
    from kvserve.kv.tier_writer import WRITE_POLICIES
    usage = ("use 'cpu:SIZE', 'disk:/path:SIZE' or 'redis://host:port/db', optionally ending in "
             "':write_through' or ':write_back', e.g. 'cpu:4GiB' or 'disk:/var/cache/kv:20GiB:write_back'")
    if not isinstance(text, str) or not text:
        raise ValueError(f"bad KV tier {text!r}: {usage}")
    place, _, policy = text.rpartition(":")
    if policy in WRITE_POLICIES and place:
        return replace(_parse_tier_place(place, text, usage), write_policy=policy)
    return _parse_tier_place(text, text, usage)


def _parse_tier_place(place: str, text: str, usage: str):
    """The tier `place` names (`text` is the whole spec, for errors)."""
    from kvserve.kv.tiers import TierSpec
    if place.startswith(("redis://", "rediss://", "unix://")):
        return TierSpec("redis", location=place)
    kind, _, rest = place.partition(":")
    if kind == "disk":
        path, _, size = rest.rpartition(":")
        spec = TierSpec("disk", _tier_size(size, text, usage), path)
        if not path:
            raise ValueError(f"bad KV tier {text!r}: the disk tier needs a directory; {usage}")
        return spec
    if kind == "cpu":
        return TierSpec("cpu", _tier_size(rest, text, usage))
    raise ValueError(f"bad KV tier {text!r}: {usage}")


def _tier_size(size: str, text: str, usage: str) -> int:
    try:
        n = parse_bytes(size)
    except ValueError:
        raise ValueError(f"bad KV tier {text!r}: cannot read a size from {size!r}; {usage}") from None
    if n <= 0:
        raise ValueError(f"bad KV tier {text!r}: the size must be > 0; {usage}")
    return n


def check_nodes(nnodes: int, node_rank: int, master_port: int, tensor_parallel_size: int | None = None) -> None:
    """ValueError for a tensor parallel launch over `nnodes` hosts that cannot run, saying what to give."""
    if nnodes < 1:
        raise ValueError(f"nnodes is how many hosts tensor parallel runs on: give 1 or more, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank is this host's place among nnodes={nnodes}: give 0..{nnodes - 1}, got {node_rank}")
    if tensor_parallel_size is not None and tensor_parallel_size % nnodes:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not split over nnodes={nnodes}: give a "
                         "tensor_parallel_size that is a multiple of nnodes (each host runs tensor_parallel_size / "
                         "nnodes ranks)")
    if not 0 <= master_port <= 65535:
        raise ValueError(f"master_port must be a TCP port (0..65535), got {master_port}")
    if nnodes > 1 and master_port == 0:
        raise ValueError(f"nnodes={nnodes} needs master_port: the port node 0's store listens on and the other "
                         "nodes connect to (e.g. master_port=29500, --master-port 29500)")


def opt(default, help: str, **cli):
    """A config field with its help text and command-line details (`kvserve.cli` builds flags from them)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    """Engine settings; `validate()` checks each field and names the bad one."""

    model: str | None = opt(None, "GGUF file or HF model directory (default: bundled SmolLM2-135M-Instruct)")
    dtype: str = opt("auto", "activations (and KV unless --kv-cache-dtype): auto (float32 on CPU with bfloat16 K/V, "
                     "bfloat16 on CUDA), float32 (all float32: the oracle), bfloat16, float16",
                     choices=["auto", *DTYPE_NAMES])
    weights: str = opt("auto", "linear weights: auto (follows --dtype if given; else on CPU each GGUF tensor in its "
                       "own block format, float32 for safetensors; bfloat16 on CUDA), gguf (each GGUF tensor in its "
                       "own block format), float32, bfloat16, float16, int8 (per channel), int4 (groups of 32)",
                       choices=["auto", GGUF_FORMAT, *WEIGHT_FORMATS])
    bf16_weight_copy: str = opt("auto", "keep a bfloat16 copy of int8/int4 weights for steps of more than 12 rows "
                                "(batched decode, prefill): auto (on a CPU with bfloat16 units, of the layers "
                                "that cannot widen their weight per call in C++ (not a GGUF's own layouts), "
                                "when the copy takes at most a quarter of the available RAM), on, off",
                                choices=["auto", "on", "off"])
    native_stack: str = opt("auto", "decode steps of up to 8 rows as one C++ call for the whole layer stack: auto "
                            "(where it runs the model: Llama-family and Gemma 3 layers on kvserve's CPU kernels; the "
                            "model's other steps then run eagerly, with no compile), off (the compiled "
                            "graphs, as for other models); docs/KERNELS.md", choices=["auto", "off"])
    device: str = opt("auto", "auto (cuda if available), cpu, cuda[:N]")
    max_model_len: int | None = opt(None, "longest sequence (default: the model's context length)")
    block_size: int | None = opt(None, "tokens per KV block (default 16; 32 for kivi formats)")
    kv_cache_memory: int | str | None = opt(None, "KV pool size, e.g. 2GiB (CPU default: 1GiB)", type=str)
    gpu_memory_utilization: float | None = opt(None, "share of device memory (of RAM on CPU) for weights + KV")
    enable_prefix_caching: bool = opt(True, "reuse cached blocks of common prefixes (the flag "
                                      "--no-prefix-caching turns it off)", flag="--no-prefix-caching")
    prefix_caching_hash_algo: str = opt(
        "sha256", "hash of prefix-cache blocks: sha256 (safe for tiers shared between engines) or xxhash "
        "(faster; pip install xxhash)", choices=["sha256", "xxhash"])
    max_num_seqs: int = opt(256, "most sequences in one step")
    max_num_batched_tokens: int = opt(2048, "token budget of one step (chunked prefill)")
    scheduling_policy: str = opt("fcfs", "fcfs: arrival order; priority: lower SamplingParams.priority first "
                                 "(then arrival), and preemption takes the lowest priority",
                                 choices=list(SCHEDULING_POLICIES))
    seed: int | None = opt(0, "engine seed")
    kv_cache_mode: str = opt("paged", "paged, contiguous (reserve max_model_len per sequence) or none "
                             "(recompute every step)", choices=list(KV_CACHE_MODES))
    attention_backend: str = opt("auto", "attention kernels: auto (Triton, or FlashInfer for 16-bit caches, on CUDA "
                                 "when installed; the C++ decode kernel on CPU; torch otherwise), torch "
                                 "(torch's ops only), triton (docs/KERNELS.md)",
                                 choices=["auto", "torch", "triton"])
    enforce_eager: bool = opt(False, "run the model eagerly: no compiled regions, no compile at start-up "
                              "(float32 weights with float32 activations, the oracle, always run eagerly; "
                              "KVSERVE_ENFORCE_EAGER=1 sets this for every engine of a process)")
    batch_invariant: bool = opt(False, "a request's greedy tokens stay the same whatever else shares its steps, "
                                "wherever its prefix came from, across preemption: one row-invariant kernel "
                                "per layer, every attention row through the CPU kernel unsplit, eager "
                                "(CPU, native K/V; docs/SERVING.md 'Batch invariance')")
    compile_mode: str = opt("background", "when the model compiles: background (the engine serves eagerly "
                            "at once and switches to the compiled graphs between two steps when they are "
                            "ready) or blocking (compile before the engine serves)", choices=list(COMPILE_MODES))
    # KV cache storage format (kvserve/kv/formats.py; docs/QUANTIZATION.md)
    kv_cache_dtype: str = opt("auto", "auto (the activations' dtype; bfloat16 under the float32 activations "
                              "--dtype auto picks on CPU), float16, bfloat16, float32, fp8_e4m3, fp8_e5m2, int8, "
                              "kivi4, kivi2 (kivi picks --block-size 32 unless told)", group="KV cache format")
    kv_cache_dtype_k: str | None = opt(None, "keys in another format than --kv-cache-dtype", group="KV cache format")
    kv_cache_dtype_v: str | None = opt(None, "values in another format than --kv-cache-dtype", group="KV cache format")
    kv_cache_dtype_skip_layers: tuple[int, ...] | list[int] | str = opt(
        (), "layers kept in full precision, e.g. 0,29", group="KV cache format", type=str)
    kv_cache_rotation: bool = opt(False, "Hadamard rotation before quantizing", group="KV cache format")
    kv_cache_head_precision: float | None = opt(
        None, "share of KV heads (the most sensitive, from a calibration run) kept in "
        "--kv-cache-head-precision-dtype", group="KV cache format")
    kv_cache_head_precision_dtype: str = opt("int8", "format of the most sensitive heads", group="KV cache format")
    swap_space: float = opt(0.0, "GiB of host memory for swapped-out requests", group="swap and KV tiers")
    preemption_mode: str = opt("auto", "how a preempted request gives back its blocks (auto: the cheaper, "
                               "needs --swap-space)", choices=["recompute", "swap", "auto"], group="swap and KV tiers")
    kv_tiers: list[str] | None = opt(None, "prefix store below the device, in lookup order (repeatable): "
                                     "cpu:4GiB, disk:/path:20GiB, redis://127.0.0.1:6379/0; append :write_through "
                                     "(default for disk, redis) or :write_back (default for cpu)",
                                     flag="--kv-tier", group="swap and KV tiers", metavar="TIER")
    kv_tier_key: str | None = field(default=None, repr=False, metadata={
        "help": "sign KV tier entries with HMAC-SHA256 under this key and serve only entries signed with it "
                "(every engine sharing a tier needs the same key; prefer --kv-tier-key-file: a flag shows in ps)",
        "group": "swap and KV tiers", "metavar": "KEY"})
    kv_tier_key_file: str | None = opt(None, "read the KV tier key (--kv-tier-key) from this file (its bytes, "
                                       "less a trailing newline), e.g. one made by `openssl rand -hex 32`",
                                       group="swap and KV tiers", metavar="PATH")
    kv_pin_fraction: float = opt(0.5, "most share of the KV pool that retention pins (a request's kv_retention) "
                                  "may hold; pins beyond it are refused, 0 turns pins off", group="swap and KV tiers")
    kv_policy: str | None = opt(None, "KV eviction for every request (docs/EVICTION.md): window:W, sinks:S,W, "
                                "h2o:HEAVY,RECENT, snapkv:BUDGET[,WINDOW,KERNEL] (budgets in tokens or a ratio "
                                "of the prompt), or full", metavar="POLICY")
    kv_events: str | None = opt(None, "publish KV cache events (block stored / removed / all cleared, one batch per "
                                "step) on this ZeroMQ PUB endpoint, e.g. tcp://127.0.0.1:5557 (pip install "
                                "'kvserve[events]'; wire format in docs/SERVING.md)", group="KV events",
                                metavar="ENDPOINT")
    kv_events_replay: str | None = opt(None, "ZeroMQ ROUTER endpoint that replays buffered event batches from a "
                                       "sequence number, e.g. tcp://127.0.0.1:5558", group="KV events",
                                       metavar="ENDPOINT")
    kv_events_allow_remote: bool = opt(False, "let --kv-events / --kv-events-replay bind an address other "
                                       "machines reach (tcp://*, a LAN address): events carry every "
                                       "tenant's prompt token ids and the sockets have no authentication",
                                       group="KV events")
    speculative_config: dict | str | None = opt(
        None, "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
        "(methods ngram, suffix, draft_model; docs/SPECULATIVE.md)", type=str, metavar="JSON")
    kv_transfer_config: dict | str | None = opt(
        None, "a KV connector that moves finished prefills' KV between engines, vLLM's JSON: "
        "'{\"kv_connector\": \"TcpConnector\", \"kv_role\": \"kv_both\"}' (connectors TcpConnector, "
        "TierConnector; roles kv_producer, kv_consumer, kv_both; docs/DISTRIBUTED.md)", type=str, metavar="JSON",
        group="distributed")
    tensor_parallel_size: int = opt(1, "processes the model is split over: attention by KV head, the MLP by "
                                    "columns and rows; gloo on CPU, NCCL on CUDA (docs/DISTRIBUTED.md)",
                                    group="distributed")
    tensor_parallel_timeout: float = opt(300.0, "seconds a tensor parallel rank waits for the others in a "
                                         "collective before the engine fails", group="distributed")
    nnodes: int = opt(1, "hosts tensor parallel runs on (torchrun's --nnodes): each runs tensor_parallel_size / "
                      "nnodes ranks; this engine is node 0, the others run `kvserve tp-node`", group="distributed")
    node_rank: int = opt(0, "this host's place among the nnodes (an engine is node 0)", group="distributed")
    master_addr: str = opt("127.0.0.1", "node 0's address that every node reaches; its store listens there",
                           group="distributed")
    master_port: int = opt(0, "port of node 0's store (0: any free port, one host only; needed when nnodes > 1)",
                           group="distributed")

    def validate(self) -> None:
        """Raise ValueError naming the first bad field; a check of the config's own values only (the
        options a subsystem understands are checked by it: engine/options.py runs them all)."""
        if self.kv_cache_mode not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache_mode must be one of {KV_CACHE_MODES}, got {self.kv_cache_mode!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.weights not in ("auto", GGUF_FORMAT, *WEIGHT_FORMATS):
            raise ValueError(f"weights must be 'auto', {GGUF_FORMAT!r} or one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        if self.bf16_weight_copy not in ("auto", "on", "off"):
            raise ValueError(f"bf16_weight_copy must be 'auto', 'on' or 'off', got {self.bf16_weight_copy!r}")
        if self.native_stack not in ("auto", "off"):
            raise ValueError(f"native_stack must be 'auto' or 'off', got {self.native_stack!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        self._validate_head_precision()
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u}")
        memory = self.kv_cache_memory_bytes()
        if memory is not None and memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {memory}")
        if not 0 <= self.kv_pin_fraction <= 1:
            raise ValueError(f"kv_pin_fraction is a share of the KV pool: give a number in [0, 1], "
                             f"got {self.kv_pin_fraction}")
        self._validate_offload()
        self._validate_kv_policy()
        self._validate_kv_events()
        self._validate_tensor_parallel()

    def kv_cache_memory_bytes(self) -> int | None:
        """kv_cache_memory in bytes (None when not given)."""
        return None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)

    def _validate_head_precision(self) -> None:
        h = self.kv_cache_head_precision
        if h is not None and not 0 < h <= 1:
            raise ValueError(f"kv_cache_head_precision is the share of KV heads kept in "
                             f"kv_cache_head_precision_dtype: give a number in (0, 1], got {h}")

    def _validate_kv_events(self) -> None:
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay replays the batches kv_events publishes: give kv_events too")
        if self.kv_events is not None and (self.kv_cache_mode == "none" or not self.enable_prefix_caching):
            raise ValueError("kv_events report the prefix cache's blocks: they need prefix caching on and "
                             f"a KV cache (kv_cache_mode 'paged' or 'contiguous', got {self.kv_cache_mode!r})")

    def _validate_tensor_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.tensor_parallel_timeout > 0:
            raise ValueError(f"tensor_parallel_timeout must be > 0 seconds, got {self.tensor_parallel_timeout}")
        check_nodes(self.nnodes, self.node_rank, self.master_port, self.tensor_parallel_size)
        # the options tensor parallel runs are checked where it is built (distributed/tensor_parallel.py)

    def _validate_kv_policy(self) -> None:
        if self.kv_policy is not None and self.kv_cache_mode != "paged":
            raise ValueError(f"kv_policy needs kv_cache_mode='paged' (per-layer block tables), got {self.kv_cache_mode!r}")

    def _validate_offload(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.preemption_mode == "swap" and not self.swap_space:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory)")
        if self.tier_names() and (self.kv_cache_mode != "paged" or not self.enable_prefix_caching):
            raise ValueError("kv_tiers extend the prefix cache: they need kv_cache_mode='paged' and prefix caching on")
        if self.kv_tier_key is not None and self.kv_tier_key_file is not None:
            raise ValueError("give the KV tier key once: kv_tier_key or kv_tier_key_file, not both")
        if (self.kv_tier_key is not None or self.kv_tier_key_file is not None) and not (
                self.tier_names() or self.kv_transfer_config):
            raise ValueError("kv_tier_key signs KV tier entries: give kv_tiers (or kv_transfer_config) too, "
                             "or leave the key out")

    def tier_names(self) -> list[str]:
        """kv_tiers as a list (one tier may be given as a string)."""
        return [self.kv_tiers] if isinstance(self.kv_tiers, str) else list(self.kv_tiers or [])

    @staticmethod
    def parse_tier(text: str):
        """One kv_tiers entry parsed into kvserve.kv.tiers.TierSpec."""
        return parse_tier_spec(text)

    def tier_specs(self) -> list:
        """kv_tiers parsed into kvserve.kv.tiers.TierSpec (ValueError naming a bad entry)."""
        return [parse_tier_spec(t) for t in self.tier_names()]

    def attention(self) -> str:
        """The attention backend every process of the engine selects (AttentionBackends.select):
        batch_invariant's own, else attention_backend."""
        return "invariant" if self.batch_invariant else self.attention_backend

    def torch_device(self) -> torch.device:
        """The device to run on."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """The weight and activation dtype."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def compiles(self, weight_format: str, eager_by_env: bool = False) -> tuple[bool, str]:
        """(whether the model's regions run compiled, why) for linear weights in `weight_format`;
        `eager_by_env`: the process asked for eager engines (EAGER_ENV, read where the engine is built)."""
        if self.enforce_eager:
            return False, "enforce_eager=True"
        if self.batch_invariant:
            return False, "batch_invariant runs eagerly (compiled graphs sum in their own orders)"
        if self.tensor_parallel_size > 1:
            return False, "tensor parallel runs eagerly"
        if eager_by_env:
            return False, f"{EAGER_ENV}=1"
        if weight_format == "float32" and self.torch_dtype() == torch.float32:
            return False, "float32 weights and activations (the oracle) run eagerly"
        return True, "compiled regions (enforce_eager=True turns them off)"

    def kv_dtype(self, model_dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
        """(the KV format kv_cache_dtype='auto' stands for here, why): bfloat16 pools under float32
        activations that dtype='auto' picked on a CPU (AUTO_KV_REASON), else what was asked."""
        if self.kv_cache_dtype != "auto" or self.kv_cache_dtype_k or self.kv_cache_dtype_v:
            return self.kv_cache_dtype, f"kv_cache_dtype={self.kv_cache_dtype}"
        if self.dtype == "auto" and device.type == "cpu" and model_dtype == torch.float32:
            return "bfloat16", AUTO_KV_REASON
        return "auto", "kv_cache_dtype=auto: the activations' dtype"

    def weight_format(self, gguf: bool = False) -> tuple[str, str]:
        """(format of the linear weights, why it was picked); `gguf`: the checkpoint is a GGUF file."""
        if self.weights == GGUF_FORMAT and not gguf:
            raise ValueError(f"weights={GGUF_FORMAT!r} keeps a GGUF file's own block formats, but the model is not "
                             f"a .gguf file; use weights='auto' or one of {WEIGHT_FORMATS}")
        if self.weights != "auto":
            return self.weights, "weights=" + self.weights
        if self.dtype != "auto":
            return self.dtype, f"weights=auto follows dtype={self.dtype}"
        if self.torch_device().type == "cuda":
            return "bfloat16", "dtype=auto on CUDA: bfloat16"
        if gguf:
            return GGUF_FORMAT, AUTO_GGUF_REASON
        return "float32", "weights=auto on CPU: float32 (a safetensors checkpoint has no blocks to keep)"
