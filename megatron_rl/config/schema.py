"""Typed run configuration.

Every section is a plain dataclass; ranges and choices live in field metadata so the loader can
validate any field generically and name it in the error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from megatron_rl.config.fields import (
    ConfigError,
    bounded,
    check_bounds,
    check_registered,
    from_dict,
)
from megatron_rl.config.prompt_template import load_template


@dataclass
class ModelConfig:
    name: str = bounded("tiny-moe", help="registry entry: configs/models/<name>.yaml")
    hf_path: str | None = bounded(None, help="a Hugging Face checkpoint folder: the policy "
                                  "starts from its weights, tokenizer and chat template, and "
                                  "its config.json picks the architecture (model.name unused)")
    dtype: str = bounded("fp32", choices=("fp32", "bf16", "fp16"))
    seq_length: int = bounded(128, ge=8, help="longest packed sequence the trainer sees")
    recompute_activations: bool = False
    recompute_granularity: str = bounded(
        "full", choices=("full", "selective"), help="with recompute_activations: full = each "
        "layer keeps only its input and is recomputed in backward; selective = megatron's "
        "core_attn recompute (the attention kernel only)")
    router_aux_loss_coef: float | None = bounded(
        None, ge=0, help="MoE load-balancing loss weight in training; None = the model's. RL "
        "from SFT: 0, since Adam turns that gradient alone into ~lr-sized moves of every "
        "weight it reaches (docs/algorithms.md)")
    layer_impl: str = bounded("auto", choices=("auto", "local", "transformer_engine"),
                              help="auto: Transformer Engine when it imports with CUDA, else local")
    fp8: str | None = bounded(None, choices=(None, "delayed", "blockwise", "mxfp8"),
                              help="FP8 training with a Transformer Engine recipe (needs TE and "
                              "a GPU with FP8: compute capability >= 8.9, mxfp8 >= 10.0); "
                              "None = bf16/fp32 (docs/fp8.md)")


@dataclass
class ParallelConfig:
    tp: int = bounded(1, ge=1, help="tensor parallel")
    pp: int = bounded(1, ge=1, help="pipeline parallel")
    ep: int = bounded(1, ge=1, help="expert parallel")
    etp: int = bounded(1, ge=1, help="expert tensor parallel")
    cp: int = bounded(1, ge=1, help="context parallel")
    sp: bool | None = bounded(None, help="sequence parallel; None = on whenever tp > 1")
    distributed_optimizer: bool = False
    moe_dispatcher: str = bounded("alltoall", choices=("alltoall", "allgather"))
    backend: str = bounded("auto", choices=("auto", "gloo", "nccl"))

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sp is None else bool(self.sp and self.tp > 1)


@dataclass
class OptimConfig:
    lr: float = bounded(1e-6, gt=0)
    min_lr: float = bounded(0.0, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    adam_beta1: float = bounded(0.9, ge=0, le=1)
    adam_beta2: float = bounded(0.98, ge=0, le=1)
    adam_eps: float = bounded(1e-8, gt=0)
    clip_grad: float = bounded(1.0, ge=0, help="0 disables clipping")
    warmup_steps: int = bounded(0, ge=0)
    lr_decay_style: str = bounded("constant", choices=("constant", "linear", "cosine"))
    lr_decay_steps: int = bounded(0, ge=0, help="steps the decay spans (Megatron's "
                                  "--lr-decay-iters); a run may stop before it ends, at a "
                                  "higher LR; 0 = train.steps")
    cpu_offload_fraction: float = bounded(
        0.0, ge=0, le=1, help="share of the optimizer states (fp32 main params, Adam moments) "
        "kept and stepped on the CPU (megatron's HybridDeviceOptimizer); needs "
        "parallel.distributed_optimizer; 0 = all on the GPU")
    frozen: tuple[str, ...] = bounded(
        (), help="regular expressions (re.search) over the Megatron parameter names that do "
        "not train, e.g. ['embedding'] (with tied embeddings the output layer too): no grads, "
        "no optimizer state; each must match a parameter")


@dataclass
class TrainConfig:
    steps: int = bounded(10, ge=1)
    global_batch_size: int = bounded(8, ge=1, help="sequences per optimizer step, all ranks")
    micro_batch_size: int = bounded(1, ge=1)
    seed: int = 1234
    log_every: int = bounded(1, ge=1)
    logprob_chunk_tokens: int = bounded(4096, ge=1,
                                        help="tokens per chunk when computing log-probs")
    logits_matmul_dtype: str | None = bounded(
        None, choices=(None, "fp32", "bf16", "fp16"), help="the output layer's matmuls (the "
        "vocabulary logits and their gradients) on inputs cast to this dtype, the softmax in "
        "fp32; None = the model's dtype. bf16 for an fp32 model on a CPU with AVX512-BF16: "
        "3-4x faster matmuls, logits to bf16's ~3 significant digits")
    max_tokens_per_microbatch: int = bounded(
        0, ge=0, help="token budget of a micro-batch per rank (dynamic batch size); 0 = "
        "fixed micro_batch_size rows")
    pack_sequences: bool = bounded(False, help="pack sequences into rows where the layers "
                                   "support it; budget: max_tokens_per_microbatch, else "
                                   "micro_batch_size x seq_length")
    share_prefixes: bool = bounded(False, help="with pack_sequences: sequences that begin "
                                   "with the same untrained tokens (a role's system prompt, a "
                                   "group's prompt) are packed behind one copy of them, which "
                                   "runs once forward and backward; the same log-probs and "
                                   "gradients, but the MoE load-balancing loss counts it once")
    output_dir: str = bounded("runs/default", help="metrics.jsonl and plots go here")


@dataclass
class CheckpointConfig:
    dir: str | None = bounded(None, help="where step_XXXXXX/ folders go; None = no saving")
    save_every: int = bounded(0, ge=0, help="steps between saves; 0 = only at the end")
    load: str | None = bounded(None, help="a checkpoint folder, or 'latest' (from dir)")
    init_from: str | None = bounded(None, help="start a new run from another run's model "
                                    "weights (a checkpoint folder or run folder): step 0, fresh "
                                    "optimizer and data cursor; checkpoint.load wins")
    keep_last: int = bounded(2, ge=1)
    export_hf_every: int = bounded(0, ge=0, help="also write an HF folder (weights, tokenizer, "
                                   "chat template) every N steps, whatever save_every (such a "
                                   "step also saves the checkpoint it is written from); 0 = off")
    export_hf: bool = bounded(False, help="write an HF folder of the final step "
                              "(<output_dir>/hf/step_N)")
    verify: str = bounded("crc32", choices=("size", "crc32"),
                          help="integrity check of every file on load")


@dataclass
class DataConfig:
    """`data`: the prompt source. verl-schema parquet/JSONL files (`data/parquet.py`); empty =
    the task's own prompts (the generated world's questions for `search`)."""

    train_files: tuple[str, ...] = bounded((), help="training prompts (.parquet / .jsonl)")
    val_files: tuple[str, ...] = bounded((), help="held-out prompts for rl.eval_every")
    curriculum: str = bounded("none", choices=("none", "bucket"),
                              help="bucket: walk extra_info.bucket (or .difficulty) in order")
    prompt_template: str | None = bounded(
        None, help="the chat the model starts from: a template NAME (configs/prompts/agents/"
        "NAME.yaml) or a YAML path rendering each prompt's {question} (config/prompt_template.py)"
        "; None = the data's own chat, else the agent's built-in prompt")

    def __post_init__(self) -> None:
        if self.prompt_template is not None:  # a missing file or bad placeholder fails at load
            load_template(self.prompt_template)


@dataclass
class SFTConfig:
    """`sft`: supervised fine-tuning (`megatron-rl sft`, `sft.py`; docs/sft.md). Files are
    trajectory JSONL (a `Trajectory.to_dict()` per line: trains exactly the generated tokens of
    turns whose loss mask is not 0) or chat rows in .parquet/.jsonl (a `messages` column of
    {role, content}: trains the assistant messages, rendered with the tokenizer's template) or
    text rows (a `text` column, e.g. a corpus: continued pre-training on every token)."""

    train_files: tuple[str, ...] = bounded((), help="training data (.jsonl / .parquet)")
    val_files: tuple[str, ...] = bounded((), help="held-out data for sft.eval_every")
    format: str = bounded("auto", choices=("auto", "trajectories", "messages", "text"),
                          help="auto: per file, a first row with `turns` is a trajectory, "
                          "with `messages` a chat, with `text` a document")
    overlong: str = bounded("truncate", choices=("truncate", "drop"),
                            help="a sequence longer than model.seq_length + 1 tokens: cut at "
                            "the boundary, or left out (both counted)")
    shuffle: bool = bounded(True, help="a new seeded order every epoch (train.seed + epoch)")
    epochs: float = bounded(0.0, ge=0.0, help="> 0: train.steps = ceil(epochs x sequences / "
                            "train.global_batch_size)")
    eval_every: int = bounded(0, ge=0, help="steps between held-out losses (and one before "
                              "the first step); 0 = off")
    eval_sequences: int = bounded(0, ge=0, help="held-out sequences evaluated, in file order; "
                                  "0 = all")
    loggers: tuple[str, ...] = bounded((), help="extra metric sinks: tensorboard, wandb")
    context_loss_weight: float = bounded(0.0, ge=0.0, le=1.0, help="loss weight of the context "
                                         "tokens (prompts, observations; never a masked "
                                         "turn's): > 0 also trains the model on the pages it "
                                         "reads, a cheap signal for a small model to learn to "
                                         "copy names from its context")
    system_loss_share: float = bounded(1.0, ge=0.0, le=1.0, help="share of the sequences "
                                       "whose system prompt context_loss_weight trains too (a "
                                       "seeded draw): the same text in every sequence, and "
                                       "each trained position costs a vocabulary matmul")
    context_loss_share: float = bounded(1.0, gt=0.0, le=1.0, help="share of the other context "
                                        "positions trained (a seeded draw per position, each "
                                        "at context_loss_weight / share: the same expected "
                                        "loss for fewer output-layer rows)")
    copy_loss_weight: float = bounded(1.0, ge=0.0, help="loss weight of the assistant's "
                                      "tokens that copy a name from the context (an added "
                                      "word of the tokenizer: data tokenizer --title-tokens): "
                                      "> 1 makes copying, a few percent of the targets, worth "
                                      "learning before the rest is memorised")


@dataclass
class ClimbConfig:
    """`climb`: Iris's SFT-RL climbing (`megatron-rl climb RECIPE`, `climb.py`; docs/sft.md).
    The recipe is the RL stage; each round selects from the last RL run's rollouts
    (`data/climb.py`), fine-tunes on them with `sft_recipe` (its model and parallel sections
    are taken from this recipe) and runs RL again from the fine-tuned weights."""

    rounds: int = bounded(1, ge=0, help="select -> SFT -> RL rounds after the first RL run")
    sft_recipe: str = bounded("tiny-moe-sft-cpu", help="the SFT stage's recipe (name or path)")
    sft_overrides: tuple[str, ...] = bounded((), help="dotted overrides of the SFT recipe")
    keep_sft_data: bool = bounded(True, help="also train each round on the SFT recipe's own "
                                  "sft.train_files, so the skills it taught are kept")
    max_pass_rate: float = bounded(0.5, gt=0.0, le=1.0, help="a query is a candidate when "
                                   "0 < pass rate <= this")
    min_tool_calls: int = bounded(1, ge=0, help="K_rft: the fewest tool calls a kept rollout "
                                  "makes")


@dataclass
class ReliabilityConfig:
    """Limits of one backend (`env/reliability.py` Guard). Times in seconds; None = off."""

    timeout_s: float = bounded(30.0, gt=0, help="per attempt, without rate-limit waits")
    max_retries: int = bounded(3, ge=0, help="extra attempts on retryable failures")
    backoff_base_s: float = bounded(0.5, ge=0, help="retry n waits base * 2**(n-1) + jitter")
    backoff_max_s: float = bounded(8.0, ge=0)
    jitter: float = bounded(0.2, ge=0, help="share of the delay added at random")
    max_retry_after_s: float = bounded(60.0, ge=0, help="a 429 asking longer fails at once")
    rate_per_s: float | None = bounded(None, gt=0, help="token-bucket rate; None = no limit")
    burst: int = bounded(1, ge=1, help="token-bucket size")
    max_concurrency: int | None = bounded(16, ge=1, help="in flight per process; None = no cap")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_bounds(f"limits.{f.name}", getattr(self, f.name), f.metadata)


@dataclass
class SearchConfig:
    """`env.search`: the backend behind the `search` tool."""

    kind: str = bounded("local", choices=("local", "http", "serper"))
    index: str | None = bounded(None, help="local: an index folder (`megatron-rl search build`); "
                                "None = the task's own (the generated world's)")
    url: str | None = bounded(None, help="http: the search service (`megatron-rl search serve`)")
    key_env: str = bounded("SERPER_API_KEY", help="serper: NAME of the variable with the key")
    top_k: int = bounded(5, ge=1, le=20, help="results per call when the call gives no top_k")
    limits: ReliabilityConfig = field(default_factory=ReliabilityConfig)


@dataclass
class SummarizerConfig:
    """`env.visit.summarizer`: how a visited page becomes the observation."""

    kind: str = bounded("extractive", choices=("extractive", "chat"))
    max_chars: int = bounded(3000, ge=100, help="extractive: characters kept")
    base_url: str | None = bounded(None, help="chat: an OpenAI-compatible base URL (…/v1)")
    pool: str | None = bounded(None, help="chat: an aux pool by name (rollout.aux_pools)")
    model: str = "default"
    key_env: str | None = bounded(None, help="chat: NAME of the variable with a bearer key")
    max_tokens: int = bounded(1024, ge=1)
    limits: ReliabilityConfig = field(default_factory=lambda: ReliabilityConfig(timeout_s=120.0))


@dataclass
class VisitConfig:
    """`env.visit`: where the `visit` tool reads pages."""

    kind: str = bounded("local", choices=("local", "http", "jina"))
    index: str | None = bounded(None, help="local: an index folder; None = env.search.index, "
                                "else the task's own")
    url: str | None = bounded(None, help="http: the search service (its /visit)")
    key_env: str = bounded("JINA_API_KEY", help="jina: NAME of the variable with the key")
    summarizer: SummarizerConfig = field(default_factory=SummarizerConfig)
    limits: ReliabilityConfig = field(default_factory=ReliabilityConfig)


@dataclass
class EnvConfig:
    """`env`: the tools' backends. Secrets are named, never given: `key_env` fields hold the
    names of environment variables."""

    search: SearchConfig = field(default_factory=SearchConfig)
    visit: VisitConfig = field(default_factory=VisitConfig)
    cache: str | None = bounded(None, help="tool-result cache: a sqlite file path; None = off")
    cache_url_env: str | None = bounded(None, help="NAME of a variable holding a Postgres URL "
                                        "for a cache shared by every worker")
    cache_ttl_s: float | None = bounded(None, gt=0, help="cache entry lifetime; None = forever")

    def __post_init__(self) -> None:
        if self.cache and self.cache_url_env:
            raise ConfigError("env.cache: set env.cache or env.cache_url_env, not both")
        for name, backend in (("search", self.search), ("visit", self.visit)):
            if backend.kind == "http" and not backend.url:
                raise ConfigError(f"env.{name}.url: required with env.{name}.kind=http")
        s = self.visit.summarizer
        if s.kind == "chat" and (s.base_url is None) == (s.pool is None):
            raise ConfigError("env.visit.summarizer: kind=chat needs base_url or pool (one)")


@dataclass
class AuxPoolConfig:
    """An auxiliary engine pool (judge, summarizer) placed beside the policy engines and handed
    to its callers as OpenAI-compatible base URLs (`http://IP:PORT/v1`)."""

    model_path: str | None = bounded(None, help="HF model dir; None = rollout.model_path")
    engine: str = bounded("embedded", registry="engine")
    num_engines: int = bounded(1, ge=1)
    engine_cpus: float = bounded(1.0, ge=0, help="CPUs in each engine's bundle")
    engine_gpus: int = bounded(0, ge=0, help="GPUs in each engine's bundle (its TP size)")
    served_model_name: str = bounded("default", help="the `model` name its /v1 API reports")


@dataclass
class RolloutConfig:
    """Rollout engines and their Ray placement (docs/placement.md).

    Trainer ranks get `trainer_ranks` bundles of {CPU: trainer_cpus[, GPU: trainer_gpus]}.
    `colocated`: policy engines live in those bundles (GPU: their memory is released while the
    trainer steps; CPU: time-sharing). `disaggregated`: each engine gets its own bundle of
    {CPU: engine_cpus[, GPU: engine_gpus]}. Aux pools always get their own bundles.
    """

    engine: str = bounded("embedded", registry="engine")
    ray: bool = bounded(False, help="`megatron-rl train` places the engines with Ray (engine "
                        "processes, SGLang, aux pools); False = one embedded engine in the "
                        "driver process")
    model_path: str | None = bounded(None, help="HF model dir the engines serve; None = "
                                                "model.name with random weights (embedded)")
    num_engines: int = bounded(1, ge=1)
    layout: str = bounded("disaggregated", choices=("colocated", "disaggregated"))
    routing: str = bounded("least_loaded", choices=("round_robin", "least_loaded"))
    trainer_ranks: int = bounded(1, ge=1, help="one bundle per trainer rank")
    trainer_cpus: float = bounded(1.0, ge=0)
    trainer_gpus: int = bounded(0, ge=0)
    engine_cpus: float = bounded(1.0, ge=0, help="an engine's CPU share; an embedded engine "
                                  "decodes on that many threads (at least 1)")
    engine_gpus: int = bounded(0, ge=0, help="GPUs per engine (its TP size); 0 = CPU")
    engine_ep: int = bounded(1, ge=1, help="SGLang expert parallel inside an engine's TP "
                             "group (--ep-size); must divide engine_gpus")
    engine_mem_fraction: float | None = bounded(
        None, gt=0, lt=1, help="SGLang --mem-fraction-static: the share of each GPU an engine "
        "claims for weights and KV cache (colocated: beside the trainer's resident state, "
        "`megatron-rl plan` checks it); None = SGLang's default")
    placement_strategy: str = bounded("PACK", choices=("PACK", "SPREAD", "STRICT_PACK",
                                                       "STRICT_SPREAD"))
    ray_address: str | None = bounded(None, help="None = start a local Ray; 'auto' or "
                                                 "host:port = attach")
    node_ip: str | None = bounded(None, help="this node's IP for Ray and the engines; "
                                             "None (and no nic) = 127.0.0.1")
    nic: str | None = bounded(None, help="network interface whose IPv4 is the node IP")
    trainer_launcher: str = bounded(
        "local", choices=("local", "ray"), help="where the trainer ranks run: local = spawned "
        "gloo ranks on this machine (or the ranks torchrun started); ray = one Ray actor per "
        "rollout.trainer_ranks bundle, on any node of the cluster (needs rollout.ray)")
    trainer_nic: str | None = bounded(
        None, help="ray launcher: the interface of the trainer's process groups on every node "
        "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); None = the one holding each node's Ray IP")
    trainer_master_addr: str | None = bounded(
        None, help="ray launcher: the address the ranks dial to reach rank 0's rendezvous; "
        "None = rank 0's IPv4 on the trainer interface")
    trainer_master_port: int = bounded(0, ge=0, le=65535, help="ray launcher: the rendezvous "
                                       "port; 0 = a free port on rank 0's node")
    preflight_timeout_s: float = bounded(30.0, gt=0, help="ray launcher: how long every rank "
                                         "may take to reach the rendezvous before the run "
                                         "fails, naming the rank")
    bucket_mb: int = bounded(512, ge=1, help="weight-update bucket size")
    sync_look_ahead: int = bounded(
        3, ge=0, le=16, help="weight sync: buckets gathered ahead of the one being sent where "
        "the gather reduces (TP); each holds up to bucket_mb of memory of its own on the "
        "trainer's device; 0 = none (trainer/weight_sync.py)")
    sync_fp8: bool = bounded(False, help="weight sync sends the projections as blockwise FP8 "
                             "+ weight_scale_inv, for engines serving an FP8 checkpoint "
                             "(docs/fp8.md)")
    max_batch_size: int = bounded(32, ge=1, help="embedded engine: running requests")
    prefix_cache: bool = bounded(True, help="embedded engines: prompts run after cached "
                                 "prefixes, shared openings and finished requests "
                                 "(engines/prefix_cache.py); SGLang keeps its radix cache")
    fast_output_layer: bool = bounded(
        False, help="embedded engines: the vocabulary logits of 1-3 rows from a transposed copy "
        "of the output weight (engines/output_layer.py; the quickstart's rollouts 0.77-0.86x "
        "their time). Its logits differ from F.linear's by float rounding in ways that follow "
        "the prefix cache's state, so a resumed run no longer repeats an uninterrupted one bit "
        "for bit")
    max_restarts: int = bounded(5, ge=0, help="engine process restarts per engine")
    health_interval_s: float = bounded(2.0, gt=0, help="how often an idle engine is checked")
    startup_timeout_s: float = bounded(600.0, gt=0)
    persist_weight_updates: bool = bounded(True, help="keep weight updates sent through the "
                                                      "pool on disk, to replay after a restart")
    state_dir: str | None = bounded(None, help="engine logs and kept weight updates; "
                                               "None = a temp dir")
    aux_pools: dict[str, AuxPoolConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # also validates direct construction (the loader only checks what it parses) and turns
        # aux-pool mappings from YAML into AuxPoolConfig
        for f in fields(self):
            check_bounds(f"rollout.{f.name}", getattr(self, f.name), f.metadata)
        if not isinstance(self.aux_pools, dict):
            raise ConfigError(f"rollout.aux_pools={self.aux_pools!r}: expected a mapping")
        pools: dict[str, AuxPoolConfig] = {}
        for name, pool in self.aux_pools.items():
            where = f"rollout.aux_pools.{name}"
            if not (isinstance(name, str) and name.replace("_", "").replace("-", "").isalnum()):
                raise ConfigError(f"{where}: pool names are letters, digits, '_' and '-'")
            if isinstance(pool, AuxPoolConfig):
                for f in fields(pool):
                    check_bounds(f"{where}.{f.name}", getattr(pool, f.name), f.metadata)
            else:
                pool = from_dict(AuxPoolConfig, pool, f"{where}.")
            if pool.engine_cpus <= 0 and pool.engine_gpus == 0:
                raise ConfigError(f"{where}.engine_cpus: a bundle needs a CPU or a GPU")
            if pool.engine == "sglang" and pool.engine_gpus < 1:
                raise ConfigError(f"{where}.engine_gpus={pool.engine_gpus}: engine=sglang "
                                  "needs >= 1")
            pools[name] = pool
        self.aux_pools = pools
        if self.node_ip is not None and self.nic is not None:
            raise ConfigError("rollout.nic: set rollout.node_ip or rollout.nic, not both")
        if self.node_ip is not None:
            import ipaddress

            try:
                ipaddress.IPv4Address(self.node_ip)
            except ValueError:
                raise ConfigError(f"rollout.node_ip={self.node_ip!r}: not an IPv4 address"
                                  ) from None
        if self.engine == "sglang":
            if self.engine_gpus < 1:
                raise ConfigError(f"rollout.engine_gpus={self.engine_gpus}: engine=sglang "
                                  "needs >= 1")
        if self.trainer_cpus <= 0 and self.trainer_gpus == 0:
            raise ConfigError("rollout.trainer_cpus: a trainer bundle needs a CPU or a GPU "
                              "(rollout.trainer_gpus)")
        if self.layout == "disaggregated" and self.engine_cpus <= 0 and self.engine_gpus == 0:
            raise ConfigError("rollout.engine_cpus: an engine bundle needs a CPU or a GPU "
                              "(rollout.engine_gpus)")
        if self.trainer_launcher == "ray" and not self.ray:
            raise ConfigError("rollout.trainer_launcher=ray: needs rollout.ray=true (the "
                              "trainer ranks are placed in the run's Ray cluster)")
        if self.layout == "colocated":
            self._check_colocated()

    def _check_colocated(self) -> None:
        if (self.engine_gpus > 0) != (self.trainer_gpus > 0):
            raise ConfigError(f"rollout.engine_gpus={self.engine_gpus}: colocated engines share "
                              f"the trainer's bundles (rollout.trainer_gpus="
                              f"{self.trainer_gpus}); both must be 0 or both > 0")
        if self.engine_gpus == 0:
            if self.num_engines > self.trainer_ranks:
                raise ConfigError(f"rollout.num_engines={self.num_engines}: colocated on CPU "
                                  f"is at most one engine per trainer bundle "
                                  f"(rollout.trainer_ranks={self.trainer_ranks})")
            return
        if self.engine_gpus % self.trainer_gpus:
            raise ConfigError(f"rollout.engine_gpus={self.engine_gpus}: must be a multiple of "
                              f"rollout.trainer_gpus={self.trainer_gpus} (an engine spans whole "
                              "trainer bundles)")
        if self.num_engines * self.engine_gpus > self.trainer_ranks * self.trainer_gpus:
            raise ConfigError(f"rollout.num_engines={self.num_engines}: {self.num_engines} x "
                              f"{self.engine_gpus} GPUs exceed the trainer's "
                              f"{self.trainer_ranks} x {self.trainer_gpus}")


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@dataclass
class PolicyLossConfig:
    """`rl.loss`: the clipped policy-gradient loss (`algorithms/policy_loss.py`), as verl's."""

    ratio_level: str = bounded("token", choices=("token", "sequence"),
                               help="sequence = GSPO (its per-token form: the sequence's ratio "
                               "value, each token's own gradient and advantage)")
    clip_ratio_low: float = bounded(0.2, ge=0.0, lt=1.0,
                                    help="ratio clipped to [1 - low, 1 + high]")
    clip_ratio_high: float = bounded(0.28, ge=0.0, help="DAPO clip-higher 0.28; PPO 0.2; "
                                     "GSPO ~4e-4")
    clip_ratio_c: float = bounded(3.0, ge=0.0, help="dual clip: a negative-advantage token's "
                                  "loss is at most -A * c (verl's clip_ratio_c); 0 = off")
    loss_agg_mode: str | None = bounded(
        None, choices=AGG_MODES, help="None: token-mean, or seq-mean-token-mean when "
        "ratio_level=sequence (GSPO's)")
    kl_coef: float = bounded(0.0, ge=0.0, help="KL to the initial policy; 0 = off")
    kl_estimator: str = bounded("k3", choices=("k1", "k3"))
    entropy_coef: float = bounded(0.0, ge=0.0, help="entropy bonus (EntroPIC may move it)")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_bounds(f"rl.loss.{f.name}", getattr(self, f.name), f.metadata)
        if 0 < self.clip_ratio_c <= 1:
            raise ConfigError(f"rl.loss.clip_ratio_c={self.clip_ratio_c}: must be > 1 (a bound "
                              "above the clipped ratio), or 0 = off")

    @property
    def aggregation(self) -> str:
        """The loss aggregation in effect."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.ratio_level == "sequence" else "token-mean"


@dataclass
class TISConfig:
    """`rl.tis`: truncated importance sampling against the engine's log-probs."""

    threshold: float = bounded(2.0, ge=0.0, help="weights above it are truncated (or masked); "
                               "0 = TIS off")
    level: str = bounded("token", choices=("token", "sequence"))
    mode: str = bounded("truncate", choices=("truncate", "mask"))
    veto_threshold: float | None = bounded(None, gt=0.0, help="a sequence with any token "
                                           "ratio below it gets weight 0")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_bounds(f"rl.tis.{f.name}", getattr(self, f.name), f.metadata)


@dataclass
class SchedulerConfig:
    """`rl.sampling`: how a step's rollout groups are collected (`rollout/scheduler.py`)."""

    samples_per_prompt: int = bounded(4, ge=1, help="GRPO group size")
    groups_per_step: int = bounded(2, ge=1)
    oversample: float = bounded(1.0, ge=1.0, help="prompts started per needed group (Iris ~2)")
    dynamic_sampling: bool = bounded(False, help="DAPO: drop zero-variance groups, refill")
    max_refills: int = bounded(4, ge=0, help="refill rounds (x groups_per_step) per step")
    dropped_group_roles: tuple[str, ...] = bounded(
        (), help="with dynamic_sampling: roles whose turns still train in the groups it drops "
        "(all outcomes equal; up to groups_per_step of them a step): a per-role reward "
        "manager (rdpo) then ranks those turns by their rubric scores alone, e.g. "
        "[synthesizer], whose extraction is scored against the evidence whatever the outcome")
    skip_settled: float = bounded(
        0.0, ge=0.0, le=0.95, help="GRESO: the chance a prompt whose last group was dropped "
        "(its outcomes all agreed) is skipped when it comes round again; it counts as drawn, "
        "and a group with differing outcomes clears it. Saves the refills dynamic sampling "
        "spends on prompts the policy always (or never) solves")
    partial_rollout: bool = bounded(
        False, help="Iris: cut in-flight sessions at the step boundary and resume them next "
        "step from their committed prefix (rollout forest)")
    one_step_off_policy: bool = bounded(
        False, help="generate step k+1's rollouts while step k trains (verl's one-step "
        "off-policy, slime's train_async): the engines never wait for the update, and the "
        "trainer's old log-probs and TIS weigh the one-version lag. Needs engines that keep "
        "their memory while the trainer steps (not Ray-placed colocated engines)")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_bounds(f"rl.sampling.{f.name}", getattr(self, f.name), f.metadata)


@dataclass
class EntropyControlConfig:
    """`rl.entropy_control`: EntroPIC's PI controller on `rl.loss.entropy_coef`."""

    target: float = bounded(0.0, ge=0.0, help="target token entropy; 0 = off")
    kp: float = bounded(0.01, ge=0.0)
    ki: float = bounded(0.001, ge=0.0)
    coef_min: float = bounded(0.0, ge=0.0)
    coef_max: float = bounded(0.1, ge=0.0)


@dataclass
class AgentLimitsConfig:
    """`rl.agent_limits`: an episode's limits besides `rl.max_turns` (`AgentConfig.limits`,
    agents/base.py)."""

    max_tool_calls_per_turn: int = bounded(4, ge=1, help="calls past it are not run "
                                           "(excess_tool_calls)")
    max_tool_calls: int = bounded(24, ge=1, help="per episode; past it the episode ends")
    max_continuations: int = bounded(2, ge=0, help="outputs cut by length resumed per message")
    max_observation_tokens: int = bounded(2048, ge=1, help="one tool result, clipped")
    tool_timeout_s: float = bounded(120.0, gt=0.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            check_bounds(f"rl.agent_limits.{f.name}", getattr(self, f.name), f.metadata)


@dataclass
class RLConfig:
    """The RL job: the task and its agent, how rollouts are grouped and rewarded, the update."""

    task: str = bounded("search", registry="task",
                        help="search: the agent over the generated world; pick_tokens: a "
                        "sanity task any policy learns; or module:attr")
    agent: str = bounded("react", registry="agent", help="react, itersynth, one_message, or "
                         "module:attr")
    world_docs: int = bounded(300, ge=30, help="pages of the generated world (embedded default)")
    tools: tuple[str, ...] = bounded(("search", "visit"), registry="tool",
                                     help="the search task's tools, by name or module:attr")
    max_turns: int = bounded(3, ge=1, help="assistant messages (ReAct) / planner steps "
                             "(IterSynth)")
    agent_limits: AgentLimitsConfig = field(default_factory=AgentLimitsConfig)
    max_new_tokens: int = bounded(24, ge=1, help="per engine call")
    temperature: float = bounded(1.0, ge=0.0)
    sampling: SchedulerConfig = field(default_factory=SchedulerConfig)
    judge: dict[str, Any] = field(default_factory=dict)   # {} = rule; see rewards.build_judge
    # {} = none; {kind: rule} = no model (the world's known path); else an OpenAI-compatible
    # rubric judge (kind: llm); see rewards.build_rubric
    rubric: dict[str, Any] = field(default_factory=dict)
    reward_manager: str = bounded(
        "grpo", registry="reward_manager",
        help="how rewards become per-turn advantages (algorithms/reward_managers.py)")
    estimator: str = bounded("grpo", choices=("grpo", "dr_grpo", "rloo"))
    rubric_weight: float = bounded(1.0, ge=0.0, help="RDPO: weight of a turn's rubric score")
    exclude_max_turns_from_loss: bool = bounded(
        False, help="max_turns trajectories count in group statistics but are not trained")
    overlong_buffer: int = bounded(0, ge=0, help="DAPO overlong penalty ramp (tokens); 0 = off")
    mini_batches_per_step: int = bounded(
        1, ge=1, help="PPO mini-batches: the step's batch split into K, one optimizer step "
        "each (old log-probs taken once, before the first)")
    ppo_epochs: int = bounded(1, ge=1, help="passes over the step's mini-batches")
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tis: TISConfig = field(default_factory=TISConfig)
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)
    sync_transport: str = bounded("tensor", choices=("tensor", "distributed", "disk"))
    routing_replay: bool = bounded(False, help="MoE R3: replay the engine's routed experts")
    tool_specs: bool = bounded(True, help="the tools' JSON schemas in the agent's system "
                               "prompt; false for a small policy that learned the call format "
                               "in SFT (data teacher / eval --no-tool-specs alike)")
    eval_every: int = bounded(0, ge=0, help="steps between held-out evaluations; 0 = off")
    eval_prompts: int = bounded(8, ge=1)
    loggers: tuple[str, ...] = bounded((), help="extra metric sinks: tensorboard, wandb")

    def __post_init__(self) -> None:
        # only `kind` here: the spec's other keys are the judge's keywords, checked when built
        for name in ("judge", "rubric"):
            spec = getattr(self, name)
            if "kind" in spec:
                check_registered(f"rl.{name}.kind", spec["kind"], name)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    climb: ClimbConfig = field(default_factory=ClimbConfig)

    def check(self) -> None:
        """Cross-field rules the per-field metadata cannot express."""
        t = self.train
        if t.global_batch_size % t.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={t.micro_batch_size}")
        if self.optim.min_lr > self.optim.lr:
            raise ConfigError(f"optim.min_lr={self.optim.min_lr} exceeds optim.lr={self.optim.lr}")
        if t.share_prefixes and not t.pack_sequences:
            raise ConfigError("train.share_prefixes: needs train.pack_sequences=true (a "
                              "prefix is shared within a packed row)")
        if self.optim.cpu_offload_fraction and not self.parallel.distributed_optimizer:
            raise ConfigError("optim.cpu_offload_fraction: needs parallel.distributed_optimizer")
        eng_ep, eng_gpus = self.rollout.engine_ep, self.rollout.engine_gpus
        if eng_ep > 1 and max(eng_gpus, 1) % eng_ep:
            raise ConfigError(f"rollout.engine_ep={eng_ep}: must divide "
                              f"rollout.engine_gpus={eng_gpus}")
        if self.model.dtype == "fp16":
            raise ConfigError("model.dtype=fp16 is not supported (use bf16 or fp32)")
        ck = self.checkpoint
        if (ck.export_hf_every or ck.export_hf) and not ck.dir:
            raise ConfigError("checkpoint.export_hf: exports are written from checkpoints; "
                              "set checkpoint.dir")
        ro = self.rollout
        served = ro.model_path or self.model.hf_path  # engines serve the policy's folder
        if ro.engine == "sglang" and served is None:
            raise ConfigError("rollout.model_path: engine=sglang needs a model directory (or "
                              "model.hf_path)")
        if self.rl.sampling.one_step_off_policy and ro.ray and ro.layout == "colocated":
            raise ConfigError("rl.sampling.one_step_off_policy: colocated engines release their "
                              "memory while the trainer steps, so nothing can generate "
                              "meanwhile; use rollout.layout=disaggregated")
        for name, pool in ro.aux_pools.items():
            if pool.model_path is None and served is None:
                raise ConfigError(f"rollout.aux_pools.{name}.model_path: required when "
                                  "neither rollout.model_path nor model.hf_path is set")
